"""The dry run of each real-size example at its documented world size: one step of the rank the
planner names (or `--rank R`), its measured peak beside the predicted one, and the wall time.

    PYTHONPATH=src .venv/bin/python benchmarks/dry_run_examples.py [name-fragment ...]

Full depth, as the examples are written (the test suite runs them cut to a few layers). The
DeepSeek-V3 example reads its published config.json (tests/data/deepseek_v3_config.json), the
others their folders under tests/data. Prints one table row per example.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from _harness import REPO

from meshforge.config.loader import load_config
from meshforge.train.dry_run import dry_run

CASES = {
    "qwen3_8b_pretrain_fsdp8.yaml": (8, "qwen3_8b"),
    "qwen3_30b_a3b_sft_ep8.yaml": (8, "qwen3_30b_a3b"),
    "llama3_1_70b_tp8_fsdp.yaml": (64, "llama3_1_70b"),
    "qwen3_next_80b_a3b_ep8_fsdp32.yaml": (32, "qwen3_next_80b_a3b"),
    "deepseek_v3_671b.yaml": (256, None),
}
GIB = 1024**3


def _folder(name: str | None, tmp: Path) -> Path:
    if name is not None:
        return REPO / "tests" / "data" / name
    published = tmp / "DeepSeek-V3"
    published.mkdir(exist_ok=True)
    shutil.copy(REPO / "tests" / "data" / "deepseek_v3_config.json", published / "config.json")
    return published


def run(only: list[str]) -> None:
    print("| example | world | rank | step (s) | measured peak GiB | predicted GiB | measured/predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (world, folder) in CASES.items():
            if only and not any(part in name for part in only):
                continue
            path = _folder(folder, Path(tmp))
            cfg = load_config(REPO / "configs" / "examples" / name, [f"--model.model_name_or_path={path}"])
            start = time.perf_counter()
            report = dry_run(cfg, world_size=world)
            seconds = time.perf_counter() - start
            predicted = report.predicted_peak_bytes or 0.0
            ratio = f"{report.peak_bytes / predicted:.2f}" if predicted else "n/a"
            print(
                f"| {name} | {world} | {report.rank} | {seconds:.0f} | {report.peak_bytes / GIB:.2f} | "
                f"{predicted / GIB:.2f} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    run(sys.argv[1:])
