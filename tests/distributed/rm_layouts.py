"""The reward-model (`training.stage: rm`) runs of the preference layout comparison.

Trained in `test_dpo_layouts.py`'s spawn (one process start for both stages): dp2 (FSDP over
both ranks; the value head sharded with the root) and tp2 (tensor and sequence parallel; the head
replicated, the hidden states gathered) for LoRA and full fine-tuning, and ep2 for a tiny
Qwen3-MoE with its router loss. Every step's loss, gradient norm and reward metric must equal the
one-process run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, runs_by_tuning
from tests.unit.test_rm_train import CONFIG, FULL, REWARDS, TINY

LAYOUTS = {"dp2": [], "tp2": ["--parallelism.tensor_parallel=2"]}
MOE = [
    *FULL,
    "--model.model_type=qwen3_moe",
    "--model.architectures=Qwen3MoeForCausalLM",
    "--model.moe_intermediate_size=64",
    "--model.num_experts=4",
    "--model.num_experts_per_tok=2",
    "--model.router_aux_loss_coef=0.01",
    "--model.output_router_logits=true",
]
TUNINGS = {"rm_lora": [], "rm_full": FULL, "rm_moe": MOE}
BY_TUNING = {"rm_lora": LAYOUTS, "rm_full": LAYOUTS, "rm_moe": {"ep2": ["--parallelism.expert_parallel=2"]}}
BASE = [*TINY, "--train_dataset.max_samples=16", "--training.steps=3"]


def rm_runs(root: Path) -> tuple[list[Run], list[Run]]:
    """The one-process runs and the 2-rank runs."""
    return runs_by_tuning(CONFIG, BASE, TUNINGS, BY_TUNING, root)


def rm_failures(root: Path) -> list[str]:
    """Every metric of every rm layout that differs from its one-process run."""
    failures = []
    for name in TUNINGS:
        one = read_metrics(root / name / "one")
        assert len({r["loss"] for r in one}) == 3, one  # it trains
        for key in BY_TUNING[name]:
            got = read_metrics(root / name / key)
            assert len(got) == len(one) == 3
            keys = ("loss", *REWARDS, *(("aux_loss",) if name == "rm_moe" else ()))
            for a, b in zip(one, got, strict=True):
                assert b["pairs"] == a["pairs"] == 8
                failures += [
                    f"{name} {key} step {a['step']} {m}: {b[m]} != {a[m]}"
                    for m in keys
                    if b[m] != pytest.approx(a[m], rel=1e-5, abs=1e-7)
                ]
                if b["grad_norm"] != pytest.approx(a["grad_norm"], rel=1e-4):
                    failures.append(
                        f"{name} {key} step {a['step']} grad_norm: {b['grad_norm']} != {a['grad_norm']}"
                    )
    return failures
