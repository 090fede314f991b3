"""The dry run of each real-size example at its documented world size: one step of the rank the
planner names (or `--rank R`), its measured peak beside the predicted one, the caching
allocator's reserved bytes replayed from the step (train/allocator_replay.py), and the wall time.

    PYTHONPATH=src .venv/bin/python benchmarks/dry_run_examples.py [name-fragment ...]

Full depth, as the examples are written (the test suite runs them cut to a few layers). The
DeepSeek-V3 example reads its published config.json (tests/data/deepseek_v3_config.json), the
others their folders under tests/data. Prints one table row per example.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from _harness import REPO
from planner_time import CASES, _model_args  # the same examples, world sizes and model folders

from meshforge.config.loader import load_config
from meshforge.train.dry_run import dry_run

GIB = 1024**3


def run(only: list[str]) -> None:
    print(
        "| example | world | rank | step (s) | measured peak GiB | predicted GiB | measured/predicted "
        "| reserved GiB | predicted reserved GiB | compute stream reserved / its peak | collective streams GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, folder) in CASES.items():
            if only and not any(part in name for part in only):
                continue
            cfg = load_config(REPO / "configs" / "examples" / name, _model_args(folder, Path(tmp)))
            start = time.perf_counter()
            report = dry_run(cfg, world_size=world)
            seconds = time.perf_counter() - start
            predicted = report.predicted_peak_bytes or 0.0
            ratio = f"{report.peak_bytes / predicted:.2f}" if predicted else "n/a"
            compute, live, side = report.reserved_split
            print(
                f"| {name} | {world} | {report.rank} | {seconds:.0f} | {report.peak_bytes / GIB:.2f} | "
                f"{predicted / GIB:.2f} | {ratio} | {report.reserved_bytes / GIB:.2f} | "
                f"{(report.predicted_reserved_bytes or 0.0) / GIB:.2f} | "
                f"{compute / GIB:.2f} / {live / GIB:.2f} | {side / GIB:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    run(sys.argv[1:])
