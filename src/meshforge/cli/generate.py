"""The `generate` sub-command's arguments (light: argparse only; the work is in `infer.run`)."""

from __future__ import annotations

import argparse


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    """Register `meshforge generate`."""
    gen = sub.add_parser(
        "generate",
        help="complete prompts with the model a config describes (HF folder or DCP step)",
        description=(
            "Generate completions with the config's model: checkpoint.load_path (a DCP step or run folder) "
            "or model.model_name_or_path (a Hugging Face folder). Options come from the inference: section; "
            "the flags below override it, and --section.key=value arguments override the file. Completions "
            "are printed and, with --output, written as JSON lines {prompt, completion, token_ids}."
        ),
    )
    gen.add_argument("--config", "-c", required=True, help="native or MindSpeed-format YAML")
    gen.add_argument("--format", choices=["native", "mindspeed"], default=None, help="config format")
    gen.add_argument("--prompt", "-p", action="append", default=[], help="a prompt text (repeatable)")
    gen.add_argument(
        "--prompts", default=None, help='JSON lines: {"prompt": text} or {"messages": [{role, content}, ...]}'
    )
    gen.add_argument("--output", "-o", default=None, help="write {prompt, completion, token_ids} lines here")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to plain-text prompts too")
    gen.add_argument(
        "--interactive", "-i", action="store_true", help="chat in the terminal (/reset clears, /exit quits)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=None, help="inference.max_new_tokens")
    gen.add_argument("--do-sample", action="store_true", default=None, help="sample (inference.do_sample)")
    gen.add_argument("--greedy", dest="do_sample", action="store_false", help="greedy decoding")
    gen.add_argument("--temperature", type=float, default=None, help="inference.temperature")
    gen.add_argument("--top-p", type=float, default=None, help="inference.top_p")
    gen.add_argument("--top-k", type=int, default=None, help="inference.top_k")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="inference.repetition_penalty")
    gen.add_argument("--seed", type=int, default=None, help="inference.seed")
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument(
        "--backend", choices=["huggingface", "meshforge"], default=None, help="inference.infer_backend"
    )
    gen.add_argument("--batch-size", type=int, default=None, help="inference.batch_size")
    gen.add_argument("--no-kv-cache", action="store_true", help="inference.use_kv_cache: false")
    gen.add_argument("--num-beams", type=int, default=None, help="beam search (inference.num_beams)")


def run_generate_command(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run `meshforge generate` from parsed arguments."""
    from meshforge.infer.run import GenerateArgs, run_generate

    return run_generate(
        GenerateArgs(
            config=args.config,
            overrides=overrides,
            prompts=list(args.prompt),
            prompts_file=args.prompts,
            output=args.output,
            chat=args.chat,
            interactive=args.interactive,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
            backend=args.backend,
            batch_size=args.batch_size,
            no_kv_cache=args.no_kv_cache,
            format=args.format,
            num_beams=args.num_beams,
        )
    )
