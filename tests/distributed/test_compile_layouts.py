"""Compiled decoder layers and the fused loss in every parallel layout: one process's numbers.

Each 2-rank run compiles its decoder layers (``kernels.compile: true``) and uses the fused linear
cross-entropy with compiled chunk steps, in the fixed parallelize order, under FSDP2, TP+SP,
CP, EP and PP, and FSDP2 with full recompute and LoRA together; each is compared with an eager one-process run with the
plain loss. The ``aot_eager`` backend traces the same graphs (dynamo, AOTAutograd, the
partition into forward and backward) without generating kernels, which keeps the five compiled
runs near a minute on 2 cores; inductor's kernels are compared with eager in
``tests/unit/test_kernels.py`` and ``tests/unit/test_lm_loss.py``. All 2-rank runs share one spawn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics, train_here
from tests.distributed._spawn import run_workers, train_runs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
TRAIN = [
    "--training.steps=3",
    "--training.deterministic=true",
    "--training.local_batch_size=2",
    "--training.log_interval=1",
    "--model.num_hidden_layers=2",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.moe_intermediate_size=32",
    "--model.num_experts=4",
    "--model.head_dim=16",
    "--train_dataset.dataloader.seq_length=32",
    "--lr_scheduler.warmup_steps=1",
    "--checkpoint.enable_save=false",
]
COMPILED = [
    "--kernels.compile=true",
    "--kernels.compile_backend=aot_eager",
    "--kernels.fused_linear_cross_entropy=true",
    "--kernels.chunk_loss_size=24",
]
EAGER = ["--kernels.compile=false", "--kernels.fused_linear_cross_entropy=false"]
LORA = ["--lora_config.target_modules=['q_proj','v_proj']", "--lora_config.lora_b_std=0.02"]
# FSDP2 over both ranks with full recompute and LoRA adapters in one run (the LoRA reference).
LAYOUTS = {
    "fsdp2_recompute_lora": ["--recompute.mode=full", "--recompute.full_recompute_layer=['0-1']", *LORA],
    "tp2": ["--parallelism.tensor_parallel=2"],
    "cp2": ["--parallelism.context_parallel=2"],
    "ep2": ["--parallelism.expert_parallel=2"],
    "pp2": ["--parallelism.pipeline_parallel=2"],
}


def _compiled_runs(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> None:
    """`train_runs`, checking after each run that it really compiled (dynamo made graphs)."""
    from torch._dynamo.utils import counters

    for run in runs:
        counters.clear()
        train_runs(rank, world, [run])
        assert counters["stats"]["unique_graphs"] > 0, run


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def test_compiled_layers_and_fused_loss_match_one_eager_process_in_every_layout(tmp_path: Path) -> None:
    plain, lora = tmp_path / "one", tmp_path / "one_lora"
    train_here(CONFIG, [*TRAIN, *EAGER, f"--training.output_dir={plain}"])
    train_here(CONFIG, [*TRAIN, *EAGER, *LORA, f"--training.output_dir={lora}"])
    runs = [
        (str(CONFIG), [*TRAIN, *COMPILED, *extra, f"--training.output_dir={tmp_path / name}"])
        for name, extra in LAYOUTS.items()
    ]
    run_workers(_compiled_runs, 2, runs, timeout=900)
    want = {"plain": _losses(plain), "lora": _losses(lora)}
    assert len(want["plain"]) == 3 and want["lora"] != want["plain"]
    for name in LAYOUTS:
        got = _losses(tmp_path / name)
        assert got == pytest.approx(want["lora" if "lora" in name else "plain"], rel=2e-5), name
