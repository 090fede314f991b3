"""The `meshforge` command.

    meshforge train [--config FILE] [--section.key=value ...]   (torchrun -m meshforge train ... for N processes)
    meshforge config {validate,show,schema,import} ...

`train` with no `--config` runs the built-in demo (tiny Qwen3 on the bundled corpus).
Heavy imports (torch, transformers) happen inside the commands that need them, so
`meshforge config ...` answers quickly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def split_overrides(extra: Sequence[str]) -> list[str]:
    """Turn `--a.b=1`, `--a.b 1` and `a.b=1` tokens into `a.b=1` strings.

    Raises:
        SystemExit: for a token that is not an override, naming it.
    """
    out: list[str] = []
    tokens = list(extra)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        body = token[2:] if token.startswith("--") else token
        if "=" in body:
            out.append(body)
            i += 1
            continue
        if token.startswith("--") and "." in body and i + 1 < len(tokens):
            out.append(f"{body}={tokens[i + 1]}")
            i += 2
            continue
        raise SystemExit(
            f"error: unrecognised argument {token!r}: overrides look like --section.key=value "
            "(e.g. --training.steps=100)"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshforge",
        description="Train language models from one YAML file (FSDP2, DCP checkpoints, HF interop).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train from a YAML config (no --config: the built-in demo)",
        description="Train from a YAML config. Extra --section.key=value arguments override the file.",
    )
    train.add_argument("--config", "-c", default=None, help="native or MindSpeed-format YAML (default: demo)")
    train.add_argument(
        "--format", choices=["native", "mindspeed"], default=None, help="config format (default: detect)"
    )
    from meshforge.config.cli import add_config_commands

    add_config_commands(sub)
    return parser


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshforge.config import ConfigError, load_config
    from meshforge.resources import builtin_config

    rank = int(os.environ.get("RANK", 0))
    path = args.config if args.config is not None else str(builtin_config("demo"))
    messages: list[str] = []
    try:
        cfg = load_config(path, overrides, fmt=args.format, log=messages.append)
    except ConfigError as err:
        if rank == 0:
            print(str(err), file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2

    from meshforge.trainer import Trainer
    from meshforge.utils.distributed import destroy_process_group
    from meshforge.utils.log import get_logger

    logger = get_logger("cli")
    if args.config is None:
        logger.info(f"meshforge train: no --config given, running the built-in demo ({path})")
    for message in messages:
        logger.info(message)
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        summary = trainer.train()
    except ConfigError as err:
        destroy_process_group(synchronize=False)
        if rank == 0:
            print(str(err), file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        destroy_process_group(synchronize=False)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BaseException:
        destroy_process_group(synchronize=False)
        raise
    destroy_process_group()
    if rank == 0:
        where = f"checkpoint {summary.last_checkpoint}" if summary.last_checkpoint else "no checkpoint saved"
        tail = summary.losses[-10:]
        smoothed = sum(tail) / len(tail) if tail else float("nan")
        first = summary.losses[0] if summary.losses else float("nan")
        logger.info(
            f"\nDone: {summary.steps} step{'' if summary.steps == 1 else 's'}, final loss {summary.final_loss:.4f} (mean of the last "
            f"{len(tail)}: {smoothed:.4f}; first step: {first:.4f}), "
            f"{summary.tokens_per_s:,.0f} tokens/s overall. Outputs in {summary.output_dir} "
            f"(config.yaml, metrics.jsonl); {where}."
            + (f" Hugging Face export in {summary.hf_export}." if summary.hf_export else "")
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        return run_train(args, split_overrides(extra))
    if extra:
        parser.error(f"unrecognised arguments: {' '.join(extra)}")
    from meshforge.config.cli import run_config_command

    return run_config_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
