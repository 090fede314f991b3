"""`optimizer.type: Muon` under dp2 (FSDP), tp2, pp2, ep2 and dp2 x tp2 equals one process.

Trainer level, qwen3_moe tiny (2-D projections, `[E, out, in]` experts and a router): the loss of
every step and every parameter after the last step (read back from the final DCP checkpoint) of
each layout match the single-process run within 1e-5 relative. Sharded matrices are
orthogonalised by one owner rank each (`optim/muon_dist.py`), so equality also proves that the
gather / scatter puts every piece back where it came from. The dp2 checkpoint then resumes in
dp2 bitwise and in one process with the same losses as the uninterrupted runs, and an AdamW
resume of it is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import rel_error
from tests.conftest import REPO, read_metrics, run_train

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
STEPS = 3
TRAIN = [
    f"--training.steps={STEPS}",
    "--training.deterministic=true",
    "--training.local_batch_size=2",
    "--training.global_batch_size=4",
    "--training.log_interval=1",
    "--optimizer.type=Muon",
    "--model.num_hidden_layers=2",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.moe_intermediate_size=32",
    "--model.num_experts=4",
    "--model.head_dim=16",
    "--train_dataset.dataloader.seq_length=32",
    "--lr_scheduler.warmup_steps=1",
    "--lr_scheduler.learning_rate=1.e-2",
    f"--checkpoint.save_interleaved_steps={STEPS - 1}",
]

LAYOUTS = {
    "dp2": (2, []),
    "tp2": (2, ["--parallelism.tensor_parallel=2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel=2"]),
    "ep2": (2, ["--parallelism.expert_parallel=2"]),
    # FSDP over TP shards: the matrices are split over both mesh dims (FSDP's strided shards).
    "dp2_tp2": (4, ["--parallelism.tensor_parallel=2"]),
}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / "weights.pt"
    dcp_to_torch_save(run / "checkpoints" / f"checkpoint-{STEPS:08d}", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def test_muon_layouts_equal_one_process_and_resume(tmp_path: Path) -> None:
    one = tmp_path / "one"
    proc = run_train(CONFIG, [*TRAIN, f"--training.output_dir={one}"], cwd=tmp_path)
    assert "optimizer Muon" in proc.stdout + proc.stderr
    want_loss = read_metrics(one)
    assert len(want_loss) == STEPS
    want = _weights(one)
    for name, (nproc, extra) in LAYOUTS.items():
        run = tmp_path / name
        run_train(CONFIG, [*TRAIN, *extra, f"--training.output_dir={run}"], nproc=nproc, cwd=tmp_path)
        got_loss = read_metrics(run)
        for a, b in zip(want_loss, got_loss, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
        got = _weights(run)
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            assert rel_error(got[key], value) < 1e-5, (name, key)

    # dp2's step-2 checkpoint: on dp2 again, step 3 and the weights after it are bitwise those of
    # the uninterrupted dp2 run (both optimizer parts restored exactly) ...
    step2 = tmp_path / "dp2" / "checkpoints" / f"checkpoint-{STEPS - 1:08d}"
    again = tmp_path / "dp2_resumed"
    run_train(
        CONFIG,
        [*TRAIN, f"--training.output_dir={again}", f"--checkpoint.load_path={step2}"],
        nproc=2,
        cwd=tmp_path,
    )
    assert read_metrics(again)[-1]["loss"] == read_metrics(tmp_path / "dp2")[-1]["loss"]
    uninterrupted = _weights(tmp_path / "dp2")
    for key, value in _weights(again).items():
        assert torch.equal(value, uninterrupted[key]), key
    # ... and in one process it continues like the uninterrupted one-process run.
    resumed = tmp_path / "resumed"
    run_train(
        CONFIG,
        [*TRAIN, f"--training.output_dir={resumed}", f"--checkpoint.load_path={step2}"],
        cwd=tmp_path,
    )
    last = read_metrics(resumed)
    assert [r["step"] for r in last] == [STEPS]
    assert last[0]["loss"] == pytest.approx(want_loss[-1]["loss"], rel=1e-5)
    with pytest.raises(AssertionError, match="holds Muon optimizer state, but optimizer.type is AdamW"):
        run_train(
            CONFIG,
            [
                *TRAIN,
                "--optimizer.type=AdamW",
                f"--training.output_dir={tmp_path / 'adamw'}",
                f"--checkpoint.load_path={step2}",
            ],
            cwd=tmp_path,
        )
