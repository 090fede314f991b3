"""Four-process layouts equal one process, and checkpoints move between layouts (tp2 -> dp2 -> 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow

# Local batch 1 keeps the global batch (4) the same for 1, 2 and 4 data-parallel ranks.
COMMON = ["--training.steps=6", "--training.local_batch_size=1", "--checkpoint.save_interleaved_steps=2"]


def _same(ref: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for x, y in zip(ref, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)


def test_four_process_layouts_and_checkpoints_across_layouts(tiny_config: Path, tmp_path: Path) -> None:
    """HSDP 2 x 2 and dp2 x tp2 on 4 processes equal one process; one run in three layouts (tp2 for
    steps 1-2, dp2 for 3-4, one process for 5-6) equals it too. One process trains in the test
    process, the 4-rank and the 2-rank runs in one spawn each."""
    out = {name: tmp_path / name for name in ("one", "hsdp", "dp_tp", "tp", "dp", "last")}
    ckpt = "checkpoints/checkpoint-{:08d}"
    tp = ["--parallelism.tensor_parallel=2", "--training.steps=2", f"--training.output_dir={out['tp']}"]
    dp = [
        "--training.steps=4",
        f"--training.output_dir={out['dp']}",
        f"--checkpoint.load_path={out['tp'] / ckpt.format(2)}",
    ]
    last = [f"--training.output_dir={out['last']}", f"--checkpoint.load_path={out['dp'] / ckpt.format(4)}"]
    train_all(
        [
            Run(tiny_config, [*COMMON, f"--training.output_dir={out['one']}"]),
            Run(
                tiny_config,
                [*COMMON, "--parallelism.data_parallel_shard=2", f"--training.output_dir={out['hsdp']}"],
                4,
            ),
            Run(
                tiny_config,
                [*COMMON, "--parallelism.tensor_parallel=2", f"--training.output_dir={out['dp_tp']}"],
                4,
            ),
            Run(tiny_config, [*COMMON, *tp], 2),
            Run(tiny_config, [*COMMON, *dp], 2),
            Run(tiny_config, [*COMMON, *last]),
        ]
    )
    ref = read_metrics(out["one"])
    _same(ref, read_metrics(out["hsdp"]))
    _same(ref, read_metrics(out["dp_tp"]))
    chained = read_metrics(out["tp"]) + read_metrics(out["dp"]) + read_metrics(out["last"])
    _same(ref, chained)
