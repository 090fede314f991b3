"""`meshforge plan CFG --world-size N --device D`: the fastest layouts that fit, before launching.

Prints a table of the fitting layouts ranked by predicted tokens/s per device (predicted peak
per rank, MFU, the step split, what bounds it), the config's own layout beside them, and, when
nothing fits, which layout came closest and by how much. `-o FILE` writes the user's native YAML
with the layout keys of the chosen layout changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.config.base import ConfigError
from meshforge.utils.hardware import HARDWARE

if TYPE_CHECKING:
    from meshforge.parallel.layout_search import Ranked, SearchResult
    from meshforge.utils.hardware import Hardware

_GIB = 1024**3


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="rank the layouts of a config on N devices by predicted speed, keeping those that fit",
        description=__doc__,
    )
    plan.add_argument("file", help="native YAML (MindSpeed files: plan them, -o needs native)")
    plan.add_argument("--world-size", type=int, required=True, help="devices the run will have")
    plan.add_argument("--device", choices=sorted(HARDWARE), required=True, help="device kind (its table row)")
    plan.add_argument(
        "--device-memory", type=float, default=None, help="GiB per device (default: the table's)"
    )
    plan.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    plan.add_argument("-o", "--output", default=None, help="write the config with the best layout here")


def _row(index: str, entry: Ranked) -> str:
    p = entry.prediction
    split = f"{p.compute:.2f}/{p.exposed_comm:.2f}/{p.bubble:.2f}/{p.optimizer:.2f}"
    return (
        f"{index:>4}  {entry.layout.describe():<66} {entry.peak_bytes / _GIB:>7.1f} "
        f"{p.tokens_per_device:>10,.0f} {100 * p.mfu:>5.1f}%  {split:<24} {p.bottleneck()}"
    )


def _report(result: SearchResult, hw: Hardware, top: int) -> list[str]:
    limit = result.limit_bytes / _GIB
    lines = [
        f"{len(result.ranked)} layout(s) fit {limit:.1f} GiB per device (95% of the memory: the predicted "
        f"peak is what the caching allocator reserves, buffers and fragmentation included, plus the CUDA context "
        f"and NCCL; the rest covers the spread of fragmentation); {len(result.too_big)} do not; "
        f"{result.invalid} excluded by the degrees, batch or model rules; searched in {result.seconds:.1f} s",
        f"{'rank':>4}  {'layout':<66} {'peak GiB':>7} {'tok/s/dev':>10} {'MFU':>6}  "
        f"{'step s: comp/comm/bubble/opt':<24} bound by",
    ]
    lines += [_row(str(i), entry) for i, entry in enumerate(result.ranked[:top], start=1)]
    if result.own is not None:
        own = result.own
        verdict = "fits" if own.peak_bytes <= result.limit_bytes else "does NOT fit"
        lines.append(_row("own", own) + f"  (the config as written; {verdict})")
    if not result.ranked:
        closest = min(result.too_big, key=lambda r: r.peak_bytes, default=None)
        if closest is None:
            lines.append("no layout is valid for this world size: see `config validate --world-size`")
        else:
            lines.append(
                f"no layout fits {limit:.1f} GiB on {hw.title}: the smallest predicted peak is "
                f"{closest.peak_bytes / _GIB:.1f} GiB, from {closest.layout.describe()}"
            )
    return lines


def _write_config(source: Path, entry: Ranked, num_layers: int, output: str) -> None:
    import yaml

    data = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    for section, keys in entry.layout.overrides(num_layers).items():
        data.setdefault(section, {}).update(keys)
    Path(output).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    print(f"wrote {output} ({entry.layout.describe()})", file=sys.stderr)


def run_plan_command(args: argparse.Namespace, overrides: list[str]) -> int:
    """Exit status: 0 when a layout fits, 2 when none does or the config is invalid."""
    try:
        return _plan(args, overrides)
    except (ConfigError, ValueError) as err:
        print(str(err) if isinstance(err, ConfigError) else f"error: {err}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshforge.config.launch_script import is_launch_script
    from meshforge.config.loader import detect_format, load_config, read_config_file
    from meshforge.parallel.layout_search import search
    from meshforge.utils.hardware import hardware

    if args.world_size < 1:
        raise ConfigError([("--world-size", f"must be >= 1, got {args.world_size}")])
    cfg = load_config(args.file, overrides, log=lambda line: print(f"import: {line}", file=sys.stderr))
    if args.output and (
        is_launch_script(args.file) or detect_format(read_config_file(args.file)[0]) != "native"
    ):
        raise ConfigError(
            [("-o", "writes native YAML only: run `meshforge config import` on this file first")]
        )
    hw = hardware(args.device)
    result = search(cfg, args.world_size, hw, memory_gib=args.device_memory, log=lambda _: None)
    for line in _report(result, hw, args.top):
        print(line)
    if args.output:
        if not result.ranked:
            print("error: nothing written: no layout fits", file=sys.stderr)
            return 2
        _write_config(Path(args.file), result.ranked[0], result.num_layers, args.output)
    return 0 if result.ranked else 2
