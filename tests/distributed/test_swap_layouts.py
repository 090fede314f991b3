"""Activation swap under dp2, tp2 and pp2 (1f1b and zero-bubble zbv) trains bitwise like no swap.

One spawn of 2 gloo processes trains the tiny qwen3 (4 layers) for three steps in each layout, with
and without swap (op swap too under dp2); the host copies are exact, so losses and gradient norms
must be equal to the last bit (deterministic mode), and every step reports the bytes it moved. Under
TP+SP the saved tensors are DTensors (their local shards are swapped and rebuilt with the same
placements). The pipeline runs hold two micro-batches in flight per rank; the zero-bubble schedule
splits backward into input and weight passes that unpack the same saved tensors twice. The single
process cases are in `tests/unit/test_swap.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG, write_corpus
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

COMMON = ["--model.num_hidden_layers=4"]
SWAP = ["--swap.enable=true", "--swap.default_prefetch=1", "--swap.layer_swap=[{layers: ['0', '2']}]"]
OP_SWAP = [
    "--swap.enable=true",
    "--swap.op_swap=[{op_name: attention, layers: ['0-2']}, {op_name: mlp, layers: ['1']}]",
]
PP2 = ["--parallelism.pipeline_parallel=2"]
LAYOUTS: dict[str, tuple[list[str], list[list[str]]]] = {
    "dp2": (["--parallelism.data_parallel_shard=2"], [SWAP, OP_SWAP]),
    "tp2": (["--parallelism.tensor_parallel=2"], [SWAP]),
    "pp2_1f1b": ([*PP2, "--parallelism.pipeline_parallel_schedule=1f1b"], [SWAP]),
    "pp2_zbv": (
        [
            *PP2,
            "--parallelism.pipeline_parallel_schedule=zbv",
            "--parallelism.pipeline_parallel_interleave_num=2",
        ],
        [SWAP],
    ),
}


def _records(config: Path, overrides: list[str], out: Path) -> list[dict]:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(config),
        [
            "--training.steps=3",
            "--training.deterministic=true",
            "--checkpoint.enable_save=false",
            f"--training.output_dir={out}",
            *COMMON,
            *overrides,
        ],
    )
    trainer = Trainer(cfg, log=lambda _line: None)
    trainer.setup()
    try:
        return [trainer.train_step() for _ in range(3)]
    finally:
        trainer.close()


def _worker(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    folder = Path(root)
    config = folder / "tiny.yaml"
    failures: list[str] = []
    for name, (layout, swaps) in LAYOUTS.items():
        ref = _records(config, layout, folder / name)
        want = [(r["loss"], r["grad_norm"]) for r in ref]
        if any("swap_bytes" in r for r in ref):
            failures.append(f"{name}: swap_bytes reported without swap")
        for i, swap in enumerate(swaps):
            got = _records(config, [*layout, *swap], folder / f"{name}_swap{i}")
            if [(r["loss"], r["grad_norm"]) for r in got] != want:
                failures.append(f"{name} swap {swap}: {got} != {want}")
            if not all(r.get("swap_bytes", 0) > 0 for r in got):
                failures.append(f"{name} swap {swap}: a step moved no bytes: {got}")
    assert not failures, "\n".join(failures)


def test_swap_is_bitwise_in_dp2_tp2_and_pp2(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.format(data=corpus))
    run_workers(_worker, 2, str(tmp_path), timeout=900)
