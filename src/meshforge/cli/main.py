"""The `meshforge` command.

    meshforge train [FILE | --config FILE] [--section.key=value | --section.key value ...]
        (torchrun -m meshforge train ... for N processes; MindSpeed-LLM's `train_fsdp2.py FILE --a.b v`
        launch lines work with `-m meshforge train` in place of the script)
    meshforge convert --to {hf,dcp} SOURCE OUT [--config run/config.yaml]
    meshforge preprocess --input FILE --output-prefix P --tokenizer DIR   (Megatron .bin/.idx)
    meshforge generate --config FILE [--prompt TEXT ...] [--prompts FILE.jsonl] [--output OUT.jsonl]
        [--chat] [--interactive] [--max-new-tokens N] [--do-sample] ... [--section.key=value ...]
        (torchrun --nproc-per-node N -m meshforge generate ... shards the model with FSDP)
    meshforge data preview [--config FILE] [--num-samples N] [--output FILE.jsonl] [--section.key=value ...]
    meshforge config {validate,show,schema,import} ...   (import: a MindSpeed YAML or a launch SCRIPT.sh)
    meshforge megatron FLAGS...   (Megatron-LM's pretrain_gpt.py flags: torchrun ... -m meshforge megatron $ARGS;
        `meshforge train SCRIPT.sh` runs a Megatron-style launch script's training line)

`train` with no `--config` runs the built-in demo (tiny Qwen3 on the bundled corpus).
Heavy imports (torch, transformers) happen inside the commands that need them, so
`meshforge config ...` answers quickly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig


def split_overrides(extra: Sequence[str]) -> list[str]:
    """Turn `--a.b=1`, `--a.b 1` (several values: a list) and `a.b=1` tokens into `a.b=1` strings.

    Raises:
        SystemExit: code 2 (a user error, as argparse exits) for a token that is not an override, after printing it.
    """
    from meshforge.config.base import ConfigError
    from meshforge.config.loader import split_cli_overrides

    try:
        return split_cli_overrides(extra)
    except ConfigError as err:
        token = err.issues[0][0]
        print(
            f"error: unrecognised argument {token!r}: overrides look like --section.key=value or "
            "--section.key value (e.g. --training.steps 100)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _positional_config(argv: list[str]) -> tuple[list[str], str | None]:
    """Take the config file given as the first argument after `train` / `data preview`.

    MindSpeed-LLM's launch scripts pass the YAML first and then the overrides; argparse cannot tell
    such a file from an override's value, so it is taken out here.
    """
    at = 1 if argv[:1] == ["train"] else 2 if argv[:2] == ["data", "preview"] else 0
    if at and len(argv) > at and not argv[at].startswith("-") and "=" not in argv[at]:
        return argv[:at] + argv[at + 1 :], argv[at]
    return argv, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshforge",
        description="Train language models from one YAML file (FSDP2, DCP checkpoints, HF interop).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train from a YAML config (none given: the built-in demo)",
        description=(
            "Train from a YAML config, given first (`train CONFIG.yaml`) or with --config. Extra "
            "--section.key=value or --section.key value arguments override the file (JSON for dicts "
            "and lists, several values for a list)."
        ),
    )
    train.add_argument("--config", "-c", default=None, help="native or MindSpeed-format YAML (default: demo)")
    train.add_argument(
        "--format",
        choices=["native", "mindspeed", "llamafactory"],
        default=None,
        help="config format (default: detect)",
    )
    convert = sub.add_parser(
        "convert",
        help="convert checkpoints: a DCP step folder to a Hugging Face folder, or back",
        description=(
            "--to hf CKPT OUT: export a DCP step folder (or a run's checkpoints folder: its latest step) as a "
            "Hugging Face folder. --to dcp HF_DIR OUT: write a HF folder's weights as a DCP step folder that "
            "checkpoint.load_path with checkpoint.no_load_optim: true loads."
        ),
    )
    convert.add_argument("--to", required=True, choices=["hf", "dcp"], help="target format")
    convert.add_argument("source", help="DCP step folder (--to hf) or Hugging Face folder (--to dcp)")
    convert.add_argument("out", help="output folder")
    convert.add_argument(
        "--config", default=None, help="--to hf: the run's config.yaml (default: CKPT/../../config.yaml)"
    )
    convert.add_argument(
        "--shard-size", default="5GB", help="--to hf: largest safetensors shard (default 5GB)"
    )
    convert.add_argument(
        "--dtype", default=None, help="--to hf: cast weights (float32, bfloat16, float16); default as trained"
    )
    data = sub.add_parser(
        "data",
        help="inspect a config's training data (data preview)",
        description="Inspect the training data a config produces, without building the model.",
    )
    data_sub = data.add_subparsers(dest="data_command", required=True)
    preview = data_sub.add_parser(
        "preview",
        help="the first rows after processing and packing, as JSON lines with the decoded text",
        description=(
            "Write the first N rows of the training data after processing and packing and before batching, "
            "in the order the trainer reads them with shuffling off: input_ids, labels (shifted, -100 = no "
            "loss), position_ids / segment_ids when present, and text (decoded, with tokens that are not "
            "loss targets inside [MASKED]...[/MASKED]). Builds only the tokenizer and the data pipeline. "
            "Extra --section.key=value arguments override the file."
        ),
    )
    preview.add_argument(
        "--config", "-c", default=None, help="native or MindSpeed-format YAML (default: demo)"
    )
    preview.add_argument(
        "--format",
        choices=["native", "mindspeed", "llamafactory"],
        default=None,
        help="config format (default: detect)",
    )
    preview.add_argument("--num-samples", "-n", type=int, default=4, help="rows to show (default 4)")
    preview.add_argument(
        "--output", "-o", default=None, help="write JSON lines here (default: print; JSON lines when piped)"
    )
    plot = sub.add_parser("plot", help="draw loss, learning rate, grad norm and tokens/s of runs into a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's training.output_dir")
    plot.add_argument(
        "--output",
        "-o",
        default=None,
        help="PNG file (default: RUN_DIR/metrics.png, ./metrics.png for several)",
    )
    from meshforge.cli.config import add_config_commands
    from meshforge.cli.generate import add_generate_command
    from meshforge.cli.megatron import add_megatron_command
    from meshforge.cli.plan import add_plan_command
    from meshforge.cli.preprocess import add_preprocess_command

    add_generate_command(sub)
    add_megatron_command(sub)
    add_plan_command(sub)

    add_preprocess_command(sub)
    add_config_commands(sub)
    return parser


def run_train(
    args: argparse.Namespace,
    overrides: list[str],
    load: Callable[[Callable[[str], None]], TrainConfig] | None = None,
) -> int:
    """`meshforge train`; `load` replaces the config file (`meshforge megatron`'s flags)."""
    from meshforge.config import ConfigError, load_config
    from meshforge.utils.resources import builtin_config

    rank = int(os.environ.get("RANK", 0))
    path = args.config if args.config is not None or load else str(builtin_config("demo"))
    messages: list[str] = []
    try:
        if load is not None:
            cfg = load(messages.append)
        else:
            cfg = load_config(path, overrides, fmt=args.format, log=messages.append)
    except ConfigError as err:
        if rank == 0:
            print(str(err), file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2

    from meshforge.checkpoint.save_failure import CheckpointSaveError
    from meshforge.train.callbacks import CallbackError, CallbackHookError, PeerCallbackError
    from meshforge.train.trainer import Trainer, TrainingDivergedError
    from meshforge.utils.distributed import destroy_process_group
    from meshforge.utils.log import get_logger

    logger = get_logger("cli")
    if args.config is None and load is None:
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
    except CallbackError as err:
        # A hook failure is agreed by every rank (the trainer reduces it); a build error comes
        # before any collective, the same on every rank.
        hook = isinstance(err, CallbackHookError | PeerCallbackError)
        destroy_process_group(synchronize=hook)
        if rank == 0 or isinstance(err, CallbackHookError):
            print(f"error: {err}", file=sys.stderr)
        return 1 if hook else 2
    except CheckpointSaveError as err:
        # Every rank stops at the same save (the ranks vote on each phase of it).
        destroy_process_group()
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except TrainingDivergedError as err:
        # Every rank stops at the same step (the trainer reduces the decision): leave together.
        destroy_process_group()
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 1
    except BaseException:
        destroy_process_group(synchronize=False)
        raise
    destroy_process_group()
    if rank == 0 and summary.preempted and load is None:  # the trainer said where its checkpoint is
        from meshforge.train.output_dir import resume_command

        world = int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        command = resume_command(
            args.config, overrides, fmt=args.format, world_size=world, local_world_size=local
        )
        logger.info(f"to resume: {command}")
    elif rank == 0:
        logger.info("\n" + summary.closing_line())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from meshforge.utils.quiet import quiet_library_output

    quiet_library_output()  # before any command imports torch, transformers or datasets
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["megatron"] and argv[1:2] not in (["-h"], ["--help"]):
        # Megatron's flags as they come (argparse would reorder options and values)
        from meshforge.cli.megatron import megatron_loader

        return run_train(argparse.Namespace(config=None, format=None), [], load=megatron_loader(argv[1:]))
    argv, positional = _positional_config(argv)
    args, extra = parser.parse_known_args(argv)
    if positional is not None:
        if args.config is not None:
            parser.error(f"the config is given twice: {positional} and --config {args.config}")
        args.config = positional
    if args.command == "train":
        return run_train(args, split_overrides(extra))
    if args.command == "generate":
        from meshforge.cli.generate import run_generate_command

        return run_generate_command(args, split_overrides(extra))
    if args.command == "plan":
        from meshforge.cli.plan import run_plan_command

        return run_plan_command(args, split_overrides(extra))
    if args.command == "data":
        from meshforge.data.preview import run_preview

        return run_preview(
            args.config,
            split_overrides(extra),
            num_samples=args.num_samples,
            output=args.output,
            fmt=args.format,
        )
    if extra:
        parser.error(f"unrecognised arguments: {' '.join(extra)}")
    if args.command == "convert":
        from meshforge.cli.convert import run_convert

        return run_convert(args)
    if args.command == "plot":
        from meshforge.monitor.plot import run_plot_command

        return run_plot_command(args.run_dirs, args.output)
    if args.command == "preprocess":
        from meshforge.cli.preprocess import run_preprocess_command

        return run_preprocess_command(args)
    from meshforge.cli.config import run_config_command

    return run_config_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
