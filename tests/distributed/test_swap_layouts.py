"""Activation swap under dp2, tp2 and pp2 (1f1b and zero-bubble zbv) trains bitwise like no swap.

Each layout runs the tiny qwen3 (4 layers) for three steps with and without swap; the host copies
are exact, so losses and gradient norms must be equal to the last bit (deterministic mode), and
every step reports the bytes it moved. Under TP+SP the saved tensors are DTensors (their local
shards are swapped and rebuilt with the same placements). The pipeline runs hold two micro-batches in flight per
rank, the zero-bubble schedule splits backward into input and weight passes that unpack the
same saved tensors twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

COMMON = ["--training.steps=3", "--model.num_hidden_layers=4", "--checkpoint.enable_save=false"]
SWAP = ["--swap.enable=true", "--swap.default_prefetch=1", "--swap.layer_swap=[{layers: ['0', '2']}]"]
OP_SWAP = [
    "--swap.enable=true",
    "--swap.op_swap=[{op_name: attention, layers: ['0-2']}, {op_name: mlp, layers: ['1']}]",
]


def _run(tiny_config: Path, tmp_path: Path, name: str, extra: list[str], nproc: int) -> list[dict]:
    out = tmp_path / name
    run_train(tiny_config, [*COMMON, *extra, f"--training.output_dir={out}"], nproc=nproc, cwd=tmp_path)
    return read_metrics(out)


def _bitwise(ref: list[dict], got: list[dict]) -> None:
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in ref
    ]
    assert all("swap_bytes" not in r for r in ref)
    assert all(r["swap_bytes"] > 0 for r in got)


def test_swap_is_bitwise_in_dp2_tp2_and_pp2(tiny_config: Path, tmp_path: Path) -> None:
    layouts = {
        "one": ([], 1),
        "dp2": (["--parallelism.data_parallel_shard=2"], 2),
        "tp2": (["--parallelism.tensor_parallel=2"], 2),
        "pp2_1f1b": (
            ["--parallelism.pipeline_parallel=2", "--parallelism.pipeline_parallel_schedule=1f1b"],
            2,
        ),
        "pp2_zbv": (
            [
                "--parallelism.pipeline_parallel=2",
                "--parallelism.pipeline_parallel_schedule=zbv",
                "--parallelism.pipeline_parallel_interleave_num=2",
            ],
            2,
        ),
    }
    for name, (extra, nproc) in layouts.items():
        ref = _run(tiny_config, tmp_path, name, extra, nproc)
        got = _run(tiny_config, tmp_path, f"{name}_swap", [*extra, *SWAP], nproc)
        _bitwise(ref, got)
        if name == "one":
            _bitwise(ref, _run(tiny_config, tmp_path, "one_op_swap", OP_SWAP, 1))
