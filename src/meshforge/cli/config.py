"""`meshforge config {validate,show,schema,import}`: inspect configs without importing torch.

`validate` runs every rule (errors exit 2 with `error: <key path>: <reason>` lines, no traceback;
features not built yet and unchecked passthrough keys are warnings, exit 0); with `--world-size` it
prints the layout's plan and memory, with `--device` the predicted step time and tokens/s. `show`
prints the resolved config, `schema` the JSON schema for editors, `import` converts a MindSpeed-LLM or
LLaMA-Factory YAML or a Megatron-style launch script (`SCRIPT.sh`) to native YAML (saying which format
it detected). Also runnable as `python -m meshforge.cli.config ...`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.config.base import ConfigError
from meshforge.utils.hardware import HARDWARE

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig

FORMATS = ["native", "mindspeed", "llamafactory"]  # as config/loader.py's FORMATS (imported lazily there)
FORMAT_NAMES = {
    "native": "native",
    "mindspeed": "MindSpeed-LLM",
    "llamafactory": "LLaMA-Factory",
    "megatron": "Megatron-style launch script",
}
# What the imported file's header calls each format.
FORMAT_TITLES = {
    "native": "native",
    "mindspeed": "MindSpeed-LLM format",
    "llamafactory": "LLaMA-Factory format",
    "megatron": "Megatron-style launch script",
}


def add_config_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register the `config` command and its sub-commands on a `meshforge` argparse subparsers object."""
    config = subparsers.add_parser(
        "config", help="validate, show, import or describe configs", description=__doc__
    )
    sub = config.add_subparsers(dest="config_command", metavar="{validate,show,schema,import}")
    sub.required = True

    validate = sub.add_parser("validate", help="check a config file against every rule")
    validate.add_argument("file", help="native or MindSpeed-format YAML")
    validate.add_argument(
        "--world-size", type=int, default=None, help="also check parallel degrees for N processes"
    )
    validate.add_argument("--format", choices=FORMATS, default=None, help="config format (default: detect)")
    validate.add_argument(
        "--device",
        choices=sorted(HARDWARE),
        default=None,
        help="also predict the step time and tokens/s on N of these devices (N = --world-size, default 1)",
    )
    validate.add_argument(
        "--dry-run",
        action="store_true",
        default=None,
        help="run one whole training step of one rank of the --world-size layout on fake tensors",
    )
    validate.add_argument(
        "--rank", type=int, default=None, help="the rank the dry run runs (default: the most loaded)"
    )
    validate.add_argument(
        "--no-path-checks",
        action="store_true",
        default=None,
        help="do not check that the data, model and checkpoint paths exist here (planning a run of another machine)",
    )
    validate.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="--section.key=value (or --section.key value) overrides",
    )

    show = sub.add_parser("show", help="print the resolved config (defaults filled) as YAML")
    show.add_argument("file", help="native or MindSpeed-format YAML")
    show.add_argument("--format", choices=FORMATS, default=None, help="config format (default: detect)")
    show.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="--section.key=value (or --section.key value) overrides",
    )

    schema = sub.add_parser("schema", help="write the JSON schema of the config (for editors)")
    schema.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")

    imp = sub.add_parser(
        "import",
        help="convert a MindSpeed-LLM or LLaMA-Factory YAML, or a Megatron-style launch script, to native YAML",
    )
    imp.add_argument(
        "file",
        help="MindSpeed-LLM or LLaMA-Factory YAML, or a launch script (SCRIPT.sh) running pretrain_gpt.py",
    )
    imp.add_argument(
        "--format", choices=FORMATS[1:], default=None, help="the file's format (default: detect)"
    )
    imp.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    imp.add_argument("-q", "--quiet", action="store_true", help="do not report what each key became")
    imp.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="overrides of MindSpeed keys (--parallel.fsdp_size 16) or native ones, as for train",
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    """The overrides (`--a.b=v`, `--a.b v`, `a.b=v`); options given after them are parsed here.

    Overrides are collected with argparse.REMAINDER (argparse has no way to accept arbitrary
    `--a.b` options), so the command's own options written after the file land there too.
    """
    from meshforge.config.loader import split_cli_overrides

    rest = argparse.ArgumentParser(add_help=False)
    own = {
        "world_size": ("--world-size",),
        "format": ("--format",),
        "output": ("-o", "--output"),
        "device": ("--device",),
        "rank": ("--rank",),
    }
    for name, flags in own.items():
        if hasattr(args, name):
            rest.add_argument(*flags, dest=name, default=None)
    if hasattr(args, "quiet"):
        rest.add_argument("-q", "--quiet", dest="quiet", action="store_true", default=None)
    for flag in ("no_path_checks", "dry_run"):
        if hasattr(args, flag):
            rest.add_argument(f"--{flag.replace('_', '-')}", dest=flag, action="store_true", default=None)
    known, remaining = rest.parse_known_args(list(getattr(args, "overrides", None) or []))
    for name, value in vars(known).items():
        if value is not None:
            setattr(args, name, int(value) if name in ("world_size", "rank") else value)
    if getattr(args, "device", None) not in (None, *HARDWARE):
        raise ConfigError(
            [("--device", f"unknown device {args.device!r}; valid: {', '.join(sorted(HARDWARE))}")]
        )
    if getattr(args, "format", None) not in (None, *FORMATS):
        raise ConfigError([("--format", f"must be one of {', '.join(FORMATS)}, got {args.format!r}")])
    return [f"--{o}" for o in split_cli_overrides(remaining)]


def _write(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text, encoding="utf-8")
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _validate(args: argparse.Namespace) -> int:
    from meshforge.config.checks import validate_config
    from meshforge.config.loader import load_config

    notes: list[str] = []
    overrides = _overrides(args)
    cfg = load_config(args.file, overrides, fmt=args.format, log=notes.append)
    report = validate_config(cfg, world_size=args.world_size)
    if not args.no_path_checks:
        from meshforge.data.inputs import input_issues

        report.errors += input_issues(cfg)
    if args.world_size and not report.errors:
        # Imports torch: the model is built on the meta device to meet the layout's rules.
        from meshforge.parallel.plan import layout_model_issues

        report.errors += layout_model_issues(cfg, args.world_size)
    for line in notes:
        print(f"import: {line}", file=sys.stderr)
    for path, reason in report.warnings:
        print(f"warning: {path}: {reason}", file=sys.stderr)
    if report.errors:
        print(str(ConfigError(report.errors)), file=sys.stderr)
        return 2
    world_size = args.world_size or (1 if args.device else None)
    where = f" for world size {world_size}" if world_size else ""
    print(f"{args.file}: valid{where} ({len(report.warnings)} warning(s))")
    if world_size:
        # Imports torch (the model is built on the meta device); plain validation does not.
        from meshforge.parallel.device_peak import peak_lines
        from meshforge.parallel.plan import plan_lines

        for line in plan_lines(cfg, world_size, log=lambda _: None):
            print(f"  {line}")
        for line in peak_lines(cfg, world_size, log=lambda _: None):
            print(f"  {line}")
    if args.device:
        for line in _throughput_lines(cfg, world_size or 1, args.device):
            print(f"  {line}")
    if args.dry_run:
        return _dry_run(cfg, world_size or 1, args.rank, args.device)
    return 0


def _dry_run(cfg: TrainConfig, world_size: int, rank: int | None, device: str | None) -> int:
    """One step of one rank on fake tensors; exit 1 with the layout and module when it fails."""
    from meshforge.train.dry_run import DryRunError, dry_run

    print(f"dry run of rank {'(most loaded)' if rank is None else rank} of {world_size}...", flush=True)
    try:
        report = dry_run(cfg, world_size=world_size, rank=rank, device=device, log=lambda _: None)
    except DryRunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, NotImplementedError) as exc:  # the layout or config, before the step ran
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    return 0


def _throughput_lines(cfg: TrainConfig, world_size: int, device: str) -> list[str]:
    """The step-time model's prediction, or the reason there is none."""
    from meshforge.parallel.step_time import predict_step, throughput_lines
    from meshforge.utils.hardware import hardware

    hw = hardware(device)
    try:
        prediction = predict_step(cfg, world_size, hw, log=lambda _: None)
    except (ValueError, NotImplementedError) as exc:
        return [f"predicted throughput: not estimated ({exc})"]
    return throughput_lines(prediction, hw)


def _import_format(args: argparse.Namespace) -> str:
    """`config import`'s format: --format, else a launch script's Megatron flags, else detected from
    the YAML; a native-looking file is MindSpeed as before (a flat file of keys both formats share)."""
    if args.format:
        return str(args.format)
    from meshforge.config.launch_script import is_launch_script

    if Path(args.file).is_file() and is_launch_script(args.file):
        return "megatron"
    from meshforge.config.loader import detect_format, read_config_file

    data, _ = read_config_file(args.file)
    kind = detect_format(data)
    return "mindspeed" if kind == "native" else kind


def run_config_command(args: argparse.Namespace) -> int:
    """Run a parsed `config` sub-command; returns the exit status (0 ok, 2 invalid config)."""
    from meshforge.config.dump import dump_config
    from meshforge.config.loader import load_config, load_native_dict
    from meshforge.config.schema import schema_json

    try:
        if args.config_command == "validate":
            return _validate(args)
        if args.config_command == "show":
            overrides = _overrides(args)
            cfg = load_config(args.file, overrides, fmt=args.format)
            _write(dump_config(cfg), None)
            return 0
        if args.config_command == "schema":
            _write(schema_json(), args.output)
            return 0
        if args.config_command == "import":
            notes: list[str] = []
            origins: dict[str, tuple[str, object]] = {}
            overrides = _overrides(args)
            # Validate the result so `import` never prints a config that `train` would reject on load.
            from meshforge.config.loader import dump_yaml, validate_imported

            try:
                data, _, kind = load_native_dict(
                    args.file, overrides, fmt=_import_format(args), log=notes.append, origins=origins
                )
                validate_imported(data, dict(origins), source=args.file, fmt=kind)
            except ConfigError:
                if not args.quiet:
                    for line in notes:
                        print(f"import: {line}", file=sys.stderr)
                raise
            if not args.quiet:
                for line in notes:
                    print(f"import: {line}", file=sys.stderr)
            if not args.quiet:
                print(f"import: detected format: {FORMAT_NAMES[kind]}", file=sys.stderr)
            header = f"# Imported from {args.file} ({FORMAT_TITLES[kind]}) by `meshforge config import`.\n"
            _write(header + dump_yaml(data), args.output)
            return 0
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    raise SystemExit(f"unknown config command {args.config_command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m meshforge.cli.config <sub-command> ...`."""
    parser = argparse.ArgumentParser(prog="meshforge")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_config_commands(subparsers)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "config":
        argv = ["config", *argv]
    args, extra = parser.parse_known_args(argv)
    bad = [e for e in extra if not (e.startswith("--") and "=" in e)]
    if bad:
        parser.error(f"unrecognised arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*(getattr(args, "overrides", None) or []), *extra]
    return run_config_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
