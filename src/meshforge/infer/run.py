"""`meshforge generate`: settings, prompts, the batch loop with progress, the output file, the chat loop.

Everything a user can get wrong (config keys, flag values, the prompts file, a chat template that is
missing) is checked before the model is built. With several processes (torchrun) every rank runs
the same batches and forwards (FSDP all-gathers must match) and rank 0 prints and writes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.infer.config import InferenceConfig
    from meshforge.infer.generate import Completion, Generator
    from meshforge.infer.prompts import Prompt

Log = Callable[[str], None]
PROGRESS_EVERY = 64  # tokens between two progress lines inside one batch


@dataclass(frozen=True)
class GenerateArgs:
    """The command line of `meshforge generate` (None: keep the config's value)."""

    config: str
    overrides: list[str]
    prompts: list[str]
    prompts_file: str | None = None
    output: str | None = None
    chat: bool = False
    interactive: bool = False
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    backend: str | None = None
    batch_size: int | None = None
    no_kv_cache: bool = False
    format: str | None = None
    num_beams: int | None = None


FLAG_OF = {
    "max_new_tokens": "--max-new-tokens",
    "do_sample": "--do-sample",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "repetition_penalty": "--repetition-penalty",
    "seed": "--seed",
    "stop_strings": "--stop",
    "infer_backend": "--backend",
    "batch_size": "--batch-size",
    "use_kv_cache": "--no-kv-cache",
    "num_beams": "--num-beams",
}


def resolve_options(cfg: TrainConfig, args: GenerateArgs) -> InferenceConfig:
    """The ``inference:`` section with the command-line flags applied (validated as the section is).

    Raises:
        ConfigError: For a bad value, naming the flag (or the key when it came from the file).
    """
    from pydantic import ValidationError

    from meshforge.config.base import ConfigError, format_validation_error
    from meshforge.infer.config import InferenceConfig

    flags = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "stop_strings": args.stop,
        "infer_backend": args.backend,
        "batch_size": args.batch_size,
        "use_kv_cache": False if args.no_kv_cache else None,
        "num_beams": args.num_beams,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    values = {**cfg.inference.model_dump(exclude_unset=True), **given}
    if values.get("num_beams") is None and cfg.train_dataset.eval_num_beams is not None:
        # MindSpeed's generation-evaluation beams: the beams of `meshforge generate` unless set here.
        values["num_beams"] = cfg.train_dataset.eval_num_beams
    try:
        return InferenceConfig.model_validate(values)
    except ValidationError as err:
        issues = format_validation_error(err, "inference")
        named = [
            (f"{FLAG_OF[path.removeprefix('inference.')]} (inference.{path.removeprefix('inference.')})", msg)
            if path.removeprefix("inference.") in given
            else (path, msg)
            for path, msg in issues
        ]
        raise ConfigError(named) from None


def _refuse(cfg: TrainConfig) -> None:
    from meshforge.config.base import ConfigError
    from meshforge.config.unsupported import unsupported_entries
    from meshforge.models.common.kernels import PRE_TOKENS_ALL

    # Adapters would change the model that generates; the other refusals concern training.
    refused = [e for e in unsupported_entries(cfg) if e.path == "lora_config"]
    if refused:
        raise ConfigError([(e.path, f"not supported yet: {e.path} ({e.note})") for e in refused])
    # The window of training (models/common/kernels.py) is not applied by the KV-cache path:
    # generating without it would attend tokens the trained model never saw together.
    if cfg.kernels.pre_tokens < PRE_TOKENS_ALL:
        raise ConfigError(
            [
                (
                    "kernels.pre_tokens",
                    "not supported yet by meshforge generate (the KV cache attends every cached token); "
                    "pass --kernels.pre_tokens=1048576 to generate without the window",
                )
            ]
        )


def _batches(items: list[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def run_generate(args: GenerateArgs, *, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """The `meshforge generate` command; returns the exit status."""
    from meshforge.config import ConfigError, load_config

    out = stdout or sys.stdout
    try:
        cfg = load_config(args.config, args.overrides, fmt=args.format)
        _refuse(cfg)
        options = resolve_options(cfg, args)
        from meshforge.infer.prompts import read_prompts

        prompts = read_prompts(args.prompts, args.prompts_file)
        if not prompts and not args.interactive:
            raise ValueError("generate: no prompt; give --prompt TEXT, --prompts FILE.jsonl or --interactive")
        if args.output and Path(args.output).is_dir():
            raise ValueError(f"--output: {args.output} is a folder; give a .jsonl file")
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _run_loaded(cfg, options, args, prompts, stdin or sys.stdin, out)


def _run_loaded(
    cfg: TrainConfig,
    options: InferenceConfig,
    args: GenerateArgs,
    prompts: list[Prompt],
    stdin: TextIO,
    out: TextIO,
) -> int:
    import torch.distributed as dist

    from meshforge.infer.generate import Generator
    from meshforge.infer.load import load_generation_model, load_tokenizer
    from meshforge.infer.prompts import encode_prompt
    from meshforge.utils.device import backend_for, resolve_device
    from meshforge.utils.distributed import destroy_process_group, env_dist_info, init_process_group
    from meshforge.utils.log import get_logger

    info = env_dist_info()
    logger = get_logger("generate")
    log: Log = logger.info if info.is_main else (lambda _m: None)
    # A group that a caller set up (a notebook, a test's ranks) is the caller's to tear down.
    owned = not dist.is_initialized()

    def leave(*, synchronize: bool) -> None:
        if owned:
            destroy_process_group(synchronize=synchronize)

    try:
        device = resolve_device(cfg.context.device_target, local_rank=info.local_rank)
        init_process_group(backend_for(device), info)
        # Prompts first: a missing chat template is an error before any weight is read.
        tokenizer = load_tokenizer(cfg, log)
        encoded = [encode_prompt(p, tokenizer, chat=args.chat) for p in prompts]
        loaded = load_generation_model(cfg, device, log, tokenizer)
        seed = options.seed if options.seed is not None else cfg.training.seed
        gen = Generator(loaded, options, seed=seed, log=log)
        if args.interactive:
            _chat_loop(gen, stdin, out, info.is_main)
        else:
            _run_batches(gen, prompts, encoded, args.output, out, log, info.is_main)
    except (ValueError, FileNotFoundError) as err:
        leave(synchronize=False)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BaseException:
        leave(synchronize=False)
        raise
    leave(synchronize=True)
    return 0


def _run_batches(
    gen: Generator,
    prompts: list[Prompt],
    encoded: list[list[int]],
    output: str | None,
    out: TextIO,
    log: Log,
    main: bool,
) -> None:
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths pad less
    results: dict[int, Completion] = {}
    batches = list(_batches(order, gen.options.batch_size))
    start = time.perf_counter()
    tokens = 0
    for number, batch in enumerate(batches, start=1):

        def every_64(step: int, number: int = number) -> None:
            # A long completion (meshforge backend) reports within the batch too.
            if (step + 1) % PROGRESS_EVERY == 0:
                log(f"generate: batch {number}/{len(batches)}: {step + 1} new tokens per row")

        done = gen.complete(
            [encoded[i] for i in batch], [prompts[i].source for i in batch], on_token=every_64
        )
        for i, completion in zip(batch, done, strict=True):
            results[i] = completion
            tokens += len(completion.token_ids)
        if len(batches) > 1:
            elapsed = time.perf_counter() - start
            log(
                f"generate: batch {number}/{len(batches)} ({len(batch)} prompts), {tokens} tokens, "
                f"{tokens / max(elapsed, 1e-9):,.1f} tokens/s"
            )
    if not main:
        return
    rows = []
    for i, prompt in enumerate(prompts):
        completion = results[i]
        rows.append(
            {"prompt": prompt.as_record(), "completion": completion.text, "token_ids": completion.token_ids}
        )
        print(f"### {prompt.source}\n{completion.text}", file=out)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        log(f"generate: wrote {len(rows)} completions to {output}")


def _chat_loop(gen: Generator, stdin: TextIO, out: TextIO, main: bool) -> None:
    """Read user turns (rank 0's stdin, shared with the other ranks), answer with the history kept."""
    import torch.distributed as dist

    from meshforge.infer.prompts import Prompt, encode_prompt

    history: list[dict[str, str]] = []
    if main:
        print("meshforge chat: /reset clears the history, /exit quits", file=out, flush=True)
    while True:
        line: str | None = None
        if main:
            print("> ", end="", file=out, flush=True)
            raw = stdin.readline()
            line = None if raw == "" else raw.rstrip("\n")
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [line]
            dist.broadcast_object_list(shared, src=0)
            line = shared[0]
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            history.clear()
            if main:
                print("(history cleared)", file=out, flush=True)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = Prompt(source=f"chat turn {len(history) // 2 + 1}", messages=tuple(history))
        ids = encode_prompt(prompt, gen.tokenizer, chat=True)
        reply = gen.complete([ids], [prompt.source])[0]
        history.append({"role": "assistant", "content": reply.text})
        if main:
            print(reply.text, file=out, flush=True)
