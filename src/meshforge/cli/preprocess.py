"""The `meshforge preprocess` subcommand: flags (Megatron's names where they apply) and its runner.

`meshforge.cli.main` adds it with `add_preprocess_command(subparsers)` and dispatches to
`run_preprocess_command(args)`. Kept light: argparse only at import time.
"""

from __future__ import annotations

import argparse
import sys

# Megatron/MindSpeed tokenizer types that mean "a Hugging Face tokenizer"; others are refused.
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "PretrainedFromHF")

DESCRIPTION = (
    "Tokenize jsonl/json/txt/csv/parquet/arrow documents into Megatron indexed files "
    "{output_prefix}_{key}_document.bin/.idx (same flags as Megatron-LM's tools/preprocess_data.py)."
)


def add_preprocess_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `preprocess` to the `meshforge` subcommands; returns its parser."""
    p = subparsers.add_parser(
        "preprocess", help="Tokenize raw documents into Megatron .bin/.idx files.", description=DESCRIPTION
    )
    p.add_argument(
        "--input", required=True, help="A .jsonl/.json/.txt/.csv/.parquet/.arrow file, or a folder of them."
    )
    p.add_argument(
        "--output-prefix", required=True, help="Output path prefix; _{key}_document.bin/.idx is added."
    )
    p.add_argument(
        "--tokenizer",
        "--tokenizer-model",
        "--tokenizer-name-or-path",
        dest="tokenizer",
        required=True,
        help="Local Hugging Face tokenizer folder (meshforge://assets/tokenizer for the bundled one).",
    )
    p.add_argument(
        "--tokenizer-type",
        default="HuggingFaceTokenizer",
        help=f"Tokenizer kind; accepted: {', '.join(TOKENIZER_TYPES)} (both mean a Hugging Face tokenizer).",
    )
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys of the text to tokenize (default: text)."
    )
    p.add_argument(
        "--append-eod", action="store_true", help="Append the end-of-document id to every document."
    )
    p.add_argument(
        "--eod-token",
        default=None,
        help="Token used as EOD; default <|endoftext|> when the tokenizer has it, else its eos_token.",
    )
    p.add_argument("--workers", type=int, default=1, help="Worker processes that parse and tokenize.")
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="Skip and count malformed records instead of stopping at the first one.",
    )
    p.add_argument("--log-interval", type=int, default=1000, help="Documents between progress reports.")
    # Megatron flags that scripts pass: accepted where they mean what meshforge does, refused otherwise.
    p.add_argument("--dataset-impl", default="mmap", help=argparse.SUPPRESS)
    p.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep-newlines", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--partitions", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--vocab-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--merge-file", default=None, help=argparse.SUPPRESS)
    return p


def _unsupported_flags(args: argparse.Namespace) -> str | None:
    """Why a Megatron flag given in `args` cannot be honoured, or None."""
    if args.dataset_impl != "mmap":
        return f"--dataset-impl {args.dataset_impl!r}: only 'mmap' (Megatron's indexed format) is written"
    if args.split_sentences:
        return "--split-sentences is not supported: each document is written as one sequence"
    if args.keep_newlines:
        return "--keep-newlines only applies with --split-sentences, which is not supported"
    if args.partitions != 1:
        return "--partitions is not supported: use --workers for parallelism (one output, input order kept)"
    if args.vocab_file or args.merge_file:
        return "--vocab-file/--merge-file are not used: pass a Hugging Face tokenizer folder with --tokenizer"
    return None


def run_preprocess_command(args: argparse.Namespace) -> int:
    """Run `meshforge preprocess`; 0 on success, 2 on a user error (printed as `error: ...`)."""
    from meshforge.data.megatron.preprocess import PreprocessError, PreprocessOptions, preprocess

    problem = _unsupported_flags(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.tokenizer_type not in TOKENIZER_TYPES:
        print(
            f"error: --tokenizer-type {args.tokenizer_type!r} is not supported: meshforge preprocess uses "
            f"Hugging Face tokenizers ({', '.join(TOKENIZER_TYPES)}); convert the tokenizer to a Hugging Face "
            "folder (tokenizer.json) and pass it with --tokenizer",
            file=sys.stderr,
        )
        return 2
    options = PreprocessOptions(
        input=args.input,
        output_prefix=args.output_prefix,
        tokenizer=args.tokenizer,
        json_keys=list(args.json_keys),
        append_eod=bool(args.append_eod),
        eod_token=args.eod_token,
        workers=int(args.workers),
        skip_invalid=bool(args.skip_invalid),
        log_interval=int(args.log_interval),
    )
    try:
        summary = preprocess(options, out=sys.stderr)
    except (PreprocessError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in summary.lines():
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m meshforge.cli.preprocess ...`) until the main CLI wires it."""
    parser = argparse.ArgumentParser(prog="meshforge")
    add_preprocess_command(parser.add_subparsers(dest="command", required=True))
    return run_preprocess_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
