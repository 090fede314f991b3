"""Wall time of `meshforge config validate --world-size N` (the planner) on each real-size example.

    PYTHONPATH=src .venv/bin/python benchmarks/planner_time.py [name-fragment ...]

The DeepSeek-V3 example plans its published config.json (tests/data/deepseek_v3_config.json),
the others their folders under tests/data; one process, after one untimed plan that pays the imports.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _harness import REPO

from meshforge.cli.main import main

CASES = {
    "qwen3_8b_pretrain_fsdp8.yaml": (8, "qwen3_8b"),
    "qwen3_30b_a3b_sft_ep8.yaml": (8, "qwen3_30b_a3b"),
    "llama3_1_70b_tp8_fsdp.yaml": (64, "llama3_1_70b"),
    "qwen3_next_80b_a3b_ep8_fsdp32.yaml": (32, "qwen3_next_80b_a3b"),
    "deepseek_v3_671b.yaml": (256, None),
}


def _model_args(folder: str | None, tmp: Path) -> list[str]:
    if folder is not None:
        return [f"--model.model_name_or_path={REPO / 'tests' / 'data' / folder}"]
    published = tmp / "DeepSeek-V3"
    published.mkdir()
    shutil.copy(REPO / "tests" / "data" / "deepseek_v3_config.json", published / "config.json")
    return [
        f"--model.model_name_or_path={published}",
        "--model.tokenizer_name_or_path=meshforge://assets/tokenizer",
    ]


def run(only: list[str]) -> None:
    _plan("qwen3_30b_a3b_sft_ep8.yaml", 8, "qwen3_30b_a3b")  # warm-up: imports and first builds
    for name, (world, folder) in CASES.items():
        if only and not any(part in name for part in only):
            continue
        status, seconds, peak = _plan(name, world, folder)
        print(f"{name}: exit {status}, {seconds:.1f} s; {peak}")


def _plan(name: str, world: int, folder: str | None) -> tuple[int, float, str]:
    """Exit status, seconds and the predicted-peak line of one `config validate`."""
    args = [
        "config",
        "validate",
        str(REPO / "configs" / "examples" / name),
        "--world-size",
        str(world),
        "--no-path-checks",
    ]
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_args(folder, Path(tmp))
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            status = main([*args, *model])
        seconds = time.perf_counter() - start
    peak = next((line.strip() for line in out.getvalue().splitlines() if "predicted peak" in line), "")
    return status, seconds, peak


if __name__ == "__main__":
    run(sys.argv[1:])
