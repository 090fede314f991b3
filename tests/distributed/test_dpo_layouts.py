"""DPO on 2 ranks equals one process: data parallel (FSDP over both) and tensor parallel (with
sequence parallelism), LoRA and full fine-tuning; expert parallel for a tiny Qwen3-MoE (full).

Full fine-tuning shards (and tensor-splits) the frozen reference copy like the policy; LoRA's
reference is the policy with its adapters off. The loss, the gradient norm and every preference
metric of each step must equal the one-process run's (the pairs split over ranks, the metrics
reduced over the `loss` mesh).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed.rm_layouts import rm_failures, rm_runs
from tests.unit.test_dpo_train import CONFIG, FULL, TINY

pytestmark = pytest.mark.slow

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


# A reward is beta times a difference of two log-probabilities of about -200 each: float32 rounds
# those to about 2e-5, so beta * 2e-5 (plus summation order) is the reward's own absolute precision.
ABS = {k: 5e-6 for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}
LAYOUTS = {"dp2": [], "tp2": ["--parallelism.tensor_parallel=2"]}
# A tiny Qwen3-MoE in place of the dense model, with its router loss.
MOE = [
    "--lora_config=null",
    "--model.model_type=qwen3_moe",
    "--model.architectures=Qwen3MoeForCausalLM",
    "--model.moe_intermediate_size=64",
    "--model.num_experts=4",
    "--model.num_experts_per_tok=2",
    "--model.router_aux_loss_coef=0.01",
    "--model.output_router_logits=true",
    "--lr_scheduler.learning_rate=1e-3",
]


def test_dp2_tp2_and_ep2_equal_one_process(tmp_path: Path) -> None:
    base = [*TINY, "--train_dataset.max_samples=16", "--training.steps=3"]
    tunings = {"lora": ["--lr_scheduler.learning_rate=2e-2"], "full": FULL, "moe": MOE}
    layouts = {"lora": LAYOUTS, "full": LAYOUTS, "moe": {"ep2": ["--parallelism.expert_parallel=2"]}}
    one_process = [
        Run(CONFIG, [*base, *extra, f"--training.output_dir={tmp_path / name / 'one'}"])
        for name, extra in tunings.items()
    ]
    two_ranks = [
        Run(CONFIG, [*base, *extra, *layout, f"--training.output_dir={tmp_path / name / key}"], 2)
        for name, extra in tunings.items()
        for key, layout in layouts[name].items()
    ]
    rm_one, rm_two = rm_runs(tmp_path)  # the reward-model runs share the spawn
    train_all([*one_process, *rm_one, *two_ranks, *rm_two])
    failures = rm_failures(tmp_path)
    for name in tunings:
        one = read_metrics(tmp_path / name / "one")
        assert len({r["loss"] for r in one}) == 3, one  # it trains
        for key in layouts[name]:
            got = read_metrics(tmp_path / name / key)
            assert len(got) == len(one) == 3
            if name == "moe":
                assert all(r["aux_loss"] > 0 for r in one), one
                failures += [
                    f"moe {key} step {a['step']} aux_loss: {b['aux_loss']} != {a['aux_loss']}"
                    for a, b in zip(one, got, strict=True)
                    if b["aux_loss"] != pytest.approx(a["aux_loss"], rel=1e-5)
                ]
            for a, b in zip(one, got, strict=True):
                assert b["pairs"] == a["pairs"] == 8
                failures += [
                    f"{name} {key} step {a['step']} {m}: {b[m]} != {a[m]}"
                    for m in METRICS
                    if b[m] != pytest.approx(a[m], rel=1e-5, abs=ABS.get(m, 1e-7))
                ]
                if b["grad_norm"] != pytest.approx(a["grad_norm"], rel=1e-4):
                    failures.append(
                        f"{name} {key} step {a['step']} grad_norm: {b['grad_norm']} != {a['grad_norm']}"
                    )
    assert not failures, "\n".join(failures)
