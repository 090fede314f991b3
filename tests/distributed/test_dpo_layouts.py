"""DPO on 2 ranks equals one process: data parallel (FSDP over both), tensor parallel (with
sequence parallelism), context parallel (each pair row split over the ranks, load-balanced) and
pipeline parallel (the pair loss on the last stage; 1F1B for LoRA, GPipe for full fine-tuning),
LoRA and full fine-tuning; expert parallel and PP with the router loss for a tiny Qwen3-MoE (full);
on 4 ranks dp2 x cp2 (LoRA) and pp2 x cp2 (full).

Full fine-tuning shards (and tensor-splits, pipeline-splits) the frozen reference copy like the
policy; LoRA's reference is the policy with its adapters off. The loss, the gradient norm and
every preference metric of each step must equal the one-process run's (the pairs split over
ranks, the metrics reduced over the `loss` mesh), and the full fine-tuning runs' validation
metrics too. A full fine-tuning PP run resumed from its step-2 checkpoint repeats step 3 bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, runs_by_tuning, train_all
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
CP2 = ["--parallelism.context_parallel=2"]
PP2 = ["--parallelism.pipeline_parallel=2"]
LAYOUTS = {"dp2": [], "tp2": ["--parallelism.tensor_parallel=2"], "cp2": CP2, "pp2": PP2}
# Validation pairs (evaluated after the last step) and a checkpoint at step 2 to resume from.
FULL_LAYOUTS = {
    **LAYOUTS,
    "pp2": [*PP2, "--parallelism.pipeline_parallel_schedule=gpipe", "--checkpoint.save_interleaved_steps=2"],
}
# On 4 ranks: CP inside data parallelism (LoRA) and inside the pipeline (full, with validation).
FOUR_RANKS = {"lora": {"dp2cp2": CP2}, "full": {"pp2cp2": [*PP2, *CP2]}}
EVAL = ["--train_dataset.val_size=4", "--training.eval_interval=3"]
EVAL_METRICS = ("eval_loss", "eval_rewards/margins", "eval_rewards/accuracies", "eval_logps/chosen")
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


def test_dp_tp_cp_pp_and_ep_layouts_equal_one_process(tmp_path: Path) -> None:
    base = [*TINY, "--train_dataset.max_samples=16", "--training.steps=3"]
    tunings = {"lora": ["--lr_scheduler.learning_rate=2e-2"], "full": [*FULL, *EVAL], "moe": MOE}
    layouts = {
        "lora": LAYOUTS,
        "full": FULL_LAYOUTS,
        "moe": {"ep2": ["--parallelism.expert_parallel=2"], "pp2": PP2},
    }
    one_process, two_ranks = runs_by_tuning(CONFIG, base, tunings, layouts, tmp_path)
    step2 = tmp_path / "full" / "pp2" / "checkpoints" / "checkpoint-00000002"
    resumed = Run(
        CONFIG,
        [
            *base,
            *tunings["full"],
            *FULL_LAYOUTS["pp2"],
            f"--checkpoint.load_path={step2}",
            f"--training.output_dir={tmp_path / 'resumed'}",
        ],
        2,
    )
    four_ranks = [
        Run(CONFIG, [*base, *tunings[name], *layout, f"--training.output_dir={tmp_path / name / key}"], 4)
        for name, runs in FOUR_RANKS.items()
        for key, layout in runs.items()
    ]
    rm_one, rm_two = rm_runs(tmp_path)  # the reward-model runs share the spawn
    train_all([*one_process, *rm_one, *two_ranks, *rm_two, resumed, *four_ranks])
    failures = rm_failures(tmp_path)
    for name in tunings:
        one = read_metrics(tmp_path / name / "one")
        assert len({r["loss"] for r in one}) == 3, one  # it trains
        for key in [*layouts[name], *FOUR_RANKS.get(name, {})]:
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
            if name == "full":  # evaluated after step 3
                assert (key, got[-1]["eval_pairs"], one[-1]["eval_pairs"]) == (key, 4, 4)
                failures += [
                    f"full {key} {m}: {got[-1][m]} != {one[-1][m]}"
                    for m in EVAL_METRICS
                    if got[-1][m] != pytest.approx(one[-1][m], rel=1e-5, abs=5e-6)
                ]
    assert not failures, "\n".join(failures)
    # The resumed PP run (the policy loaded, the reference pipeline rebuilt) repeats step 3 bitwise.
    keys = ("loss", "grad_norm", "pairs", *METRICS)
    whole = read_metrics(tmp_path / "full" / "pp2")
    again = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in again] == [3]
    assert {k: again[0][k] for k in keys} == {k: whole[2][k] for k in keys}


# torchft's own logger calls the deprecated Logger.warn.
@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
def test_torchft_replica_groups_equal_one_process(tmp_path: Path) -> None:
    """Two torchft replica groups (one process each) give one process's steps and pair metrics.

    Group 0 trains in this process, group 1 in a fresh one, against a lighthouse here; each group
    reads half of every global batch, and the pair counts and reward sums are summed over both.
    """
    pytest.importorskip("torchft")
    import subprocess

    from torchft._torchft import LighthouseServer

    from tests.conftest import meshforge_cmd, train_here, worker_env

    base = [
        *TINY,
        "--train_dataset.max_samples=16",
        "--training.steps=3",
        "--lr_scheduler.learning_rate=2e-2",
    ]
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )

    def group(g: int) -> list[str]:
        return [
            *base,
            f"--training.output_dir={tmp_path / f'g{g}'}",
            "--checkpoint.enable_save=false",
            "--parallelism.fault_tolerance.enable=true",
            f"--parallelism.fault_tolerance.replica_id={g}",
            f"--parallelism.fault_tolerance.lighthouse={lighthouse.address()}",
            "--parallelism.fault_tolerance.quorum_timeout_s=60",
        ]

    log = tmp_path / "g1.log"
    with log.open("w") as sink:
        peer = subprocess.Popen(
            meshforge_cmd("train", "--config", str(CONFIG), *group(1)),
            cwd=tmp_path,
            env=worker_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        train_here(CONFIG, group(0))
        peer.wait(timeout=120)
    finally:
        if peer.poll() is None:
            peer.kill()
        lighthouse.shutdown()
    assert peer.returncode == 0, log.read_text()[-4000:]
    train_here(CONFIG, [*base, f"--training.output_dir={tmp_path / 'one'}"])
    one = read_metrics(tmp_path / "one")
    failures = []
    for g in (0, 1):
        got = read_metrics(tmp_path / f"g{g}")
        assert [r["replicas"] for r in got] == [2, 2, 2] and len(one) == 3
        for a, b in zip(one, got, strict=True):
            assert b["pairs"] == a["pairs"] == 8
            failures += [
                f"group {g} step {a['step']} {m}: {b[m]} != {a[m]}"
                for m in (*METRICS, "grad_norm")
                if b[m] != pytest.approx(a[m], rel=1e-5, abs=ABS.get(m, 1e-7))
            ]
    assert not failures, "\n".join(failures)
