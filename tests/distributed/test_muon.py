"""`optimizer.type: Muon` under dp2 (FSDP), tp2, pp2, ep2 and dp2 x tp2 equals one process.

Trainer level, qwen3_moe tiny (2-D projections, `[E, out, in]` experts and a router): the loss of
every step and every parameter after the last step (read back from the final DCP checkpoint) of
each layout match the single-process run within 1e-5 relative. Sharded matrices are
orthogonalised by one owner rank each (`optim/muon_dist.py`), so equality also proves that the
gather / scatter puts every piece back where it came from. The dp2 checkpoint then resumes in
dp2 bitwise and in one process with the same losses as the uninterrupted runs, and an AdamW
resume of it is refused. The layouts run as real trainings in two spawns of gloo processes (2 and
4 ranks), the single-process runs in the test's own process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from tests._compare import rel_error
from tests.conftest import REPO, read_metrics, train_here
from tests.distributed._spawn import run_workers

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

# Layouts of the 2-rank spawn; FSDP over TP shards (the matrices split over both mesh dims, FSDP's
# strided shards) runs in its own 4-rank spawn.
LAYOUTS2 = {
    "dp2": [],
    "tp2": ["--parallelism.tensor_parallel=2"],
    "pp2": ["--parallelism.pipeline_parallel=2"],
    "ep2": ["--parallelism.expert_parallel=2"],
}
LAYOUT4 = ("dp2_tp2", ["--parallelism.tensor_parallel=2"])


def _step2(root: Path) -> Path:
    return root / "dp2" / "checkpoints" / f"checkpoint-{STEPS - 1:08d}"


def _train(out: Path, extra: list[str]) -> None:
    train_here(CONFIG, [*TRAIN, *extra, f"--training.output_dir={out}"])


def _worker2(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    folder = Path(root)
    for name, extra in LAYOUTS2.items():
        _train(folder / name, extra)
    # dp2's step-2 checkpoint, resumed on dp2 again.
    _train(folder / "dp2_resumed", [f"--checkpoint.load_path={_step2(folder)}"])


def _worker4(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    name, extra = LAYOUT4
    _train(Path(root) / name, extra)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / "weights.pt"
    dcp_to_torch_save(run / "checkpoints" / f"checkpoint-{STEPS:08d}", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def test_muon_layouts_equal_one_process_and_resume(tmp_path: Path) -> None:
    one = tmp_path / "one"
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("meshforge.optim.build")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        _train(one, [])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any(line.startswith("optimizer Muon") for line in seen), seen
    want_loss = read_metrics(one)
    assert len(want_loss) == STEPS
    want = _weights(one)
    run_workers(_worker2, 2, str(tmp_path), timeout=900)
    run_workers(_worker4, 4, str(tmp_path), timeout=600)
    for name in [*LAYOUTS2, LAYOUT4[0]]:
        run = tmp_path / name
        got_loss = read_metrics(run)
        for a, b in zip(want_loss, got_loss, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
        got = _weights(run)
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            assert rel_error(got[key], value) < 1e-5, (name, key)

    # On dp2 again, step 3 and the weights after it are bitwise those of the uninterrupted dp2
    # run (both optimizer parts restored exactly) ...
    again = tmp_path / "dp2_resumed"
    assert read_metrics(again)[-1]["loss"] == read_metrics(tmp_path / "dp2")[-1]["loss"]
    uninterrupted = _weights(tmp_path / "dp2")
    for key, value in _weights(again).items():
        assert torch.equal(value, uninterrupted[key]), key
    # ... and in one process it continues like the uninterrupted one-process run.
    step2 = _step2(tmp_path)
    resumed = tmp_path / "resumed"
    _train(resumed, [f"--checkpoint.load_path={step2}"])
    last = read_metrics(resumed)
    assert [r["step"] for r in last] == [STEPS]
    assert last[0]["loss"] == pytest.approx(want_loss[-1]["loss"], rel=1e-5)
    with pytest.raises(Exception, match="holds Muon optimizer state, but optimizer.type is AdamW"):
        _train(tmp_path / "adamw", ["--optimizer.type=AdamW", f"--checkpoint.load_path={step2}"])
