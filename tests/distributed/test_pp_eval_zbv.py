"""Evaluation through the zbv (zero-bubble V) pipeline schedule equals one process (2 processes, gloo).

The V placement puts stages ``r`` and ``2 * pp - 1 - r`` on pp rank ``r``, so the last rank runs
two adjacent stages and hands activations between them locally. torch's runtime in eval mode
still ran the schedule's backward actions and failed on that local hand-off; ``Pipeline.evaluate``
now runs the schedule's forward actions only. Checked directly on ``Pipeline`` (train, evaluate,
train again, evaluate again: the CE sums of every evaluation and the training gradients equal one
process, tied and untied heads, packed documents, and one FSDP-wrapped model) and through
``meshforge train`` (eval_loss of pp2 zbv equals one process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import assert_close
from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

VOCAB, SEQ, MB, N_MICRO = 64, 8, 2, 4
RTOL = 1e-5

# (name, layers_per_stage, tied, fsdp); stages 0 and 3 on rank 0, stages 1 and 2 on rank 1.
CASES = [
    ("zbv tied uneven", ["0,4", "1-2,3"], True, False),
    ("zbv untied", ["0,4", "1,2-3"], False, False),
    ("zbv fsdp tied", ["0-1,4", "2,3"], True, True),
]


def _args(tied: bool):
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )


def _micro_batches(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_MICRO):
        ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels[:, : i % 3] = -100
        seg = torch.tensor([[1] * 3 + [2] * (SEQ - 3), [1] * (SEQ - 2) + [0] * 2])
        out.append({"input_ids": ids, "labels": labels.masked_fill(seg == 0, -100), "segment_ids": seg})
    return out


def _build(tied: bool, device: str = "cpu"):
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.qwen3.model import build_qwen3

    model = build_qwen3(_args(tied), device="meta")
    if device == "meta":
        return model
    materialize_and_init(model, device=torch.device("cpu"), seed=11, init_fn=model.init_full_parameter_)
    return model


def _ce(model, micro) -> torch.Tensor:
    from meshforge.loss.cross_entropy import cross_entropy_sum

    with torch.no_grad():
        return sum(
            cross_entropy_sum(model(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            for mb in micro
        )


def _reference(tied: bool, train, evals, steps: int):
    """Per step: the eval CE sum before it, and its gradients; then the final eval CE sum."""
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    model = _build(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in train)
    history = []
    for _ in range(steps):
        before = _ce(model, evals)
        opt.zero_grad()
        for mb in train:
            ce = cross_entropy_sum(model(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            (ce / tokens).backward()
        history.append(
            (before, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        )
        opt.step()
    return history, _ce(model, evals), tokens


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run_case(rank: int, case, pp_mesh, dp_mesh) -> None:
    from meshforge.parallel.fsdp import apply_fsdp
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name, spec, tied, fsdp = case
    train, evals = _micro_batches(3), _micro_batches(4)
    history, final_ce, tokens = _reference(tied, train, evals, steps=2)
    model = _build(tied, "meta" if fsdp else "cpu")
    split = split_model(model, pp_rank=rank, pp_size=2, layers_per_stage=spec, interleave=2, schedule="zbv")
    assert [s.index for s in split.stages] == ([0, 3] if rank == 0 else [1, 2])
    if fsdp:
        from meshforge.models.materialize import materialize_and_init

        apply_fsdp(split.model, dp_mesh, param_dtype=None, reduce_dtype=torch.float32, pipeline_parallel=True)
        materialize_and_init(
            split.model, device=torch.device("cpu"), seed=11, init_fn=split.model.init_full_parameter_
        )
    opt = torch.optim.AdamW(split.model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = build_pipeline(split, split.model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule="zbv")
    for step, (want_eval, want_grads) in enumerate(history):
        # Evaluation between training steps: the same CE sum on every rank, then training goes on
        # (the stages switch between eval and train set-ups each time).
        grads = [None if p.grad is None else p.grad.clone() for p in split.model.parameters()]
        got = pipe.evaluate(evals)
        assert got.dim() == 0 and not got.requires_grad
        assert_close(got, want_eval, floor=1e-6, what=f"[{name}] evaluate before step {step} on rank {rank}")
        for p, before in zip(split.model.parameters(), grads, strict=True):
            # No gradient from evaluation (torch's stage set-up for eval may drop old ones).
            unchanged = p.grad is None or (before is not None and torch.equal(p.grad, before))
            assert unchanged, f"[{name}] evaluation changed a gradient"
        opt.zero_grad()
        pipe.step(train, tokens)
        for n, p in split.model.named_parameters():
            assert_close(_full(p.grad), want_grads[n], floor=1e-6, what=f"[{name}] step {step} grad {n}")
        opt.step()
    assert_close(pipe.evaluate(evals), final_ce, floor=1e-6, what=f"[{name}] final evaluate on rank {rank}")


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    for case in CASES:
        torch.manual_seed(0)
        _run_case(rank, case, mesh["pp"], mesh["dp"])


def test_pp2_zbv_evaluate_equals_one_process() -> None:
    run_workers(_worker, 2)


def test_trainer_pp2_zbv_eval_loss_equals_one_process(tmp_path: Path) -> None:
    sft = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
    common = [
        "--training.steps=2",
        "--training.log_interval=1",
        "--training.eval_interval=1",
        "--training.eval_iters=3",
        "--train_dataset.val_size=24",
        "--train_dataset.max_samples=120",
        "--checkpoint.enable_save=false",
    ]
    one, zbv = tmp_path / "one", tmp_path / "zbv"
    train_one(sft, [*common, f"--training.output_dir={one}"], cwd=tmp_path)
    train_one(
        sft,
        [
            *common,
            "--parallelism.pipeline_parallel=2",
            "--parallelism.pipeline_parallel_schedule=zbv",
            "--parallelism.pipeline_parallel_interleave_num=2",
            f"--training.output_dir={zbv}",
        ],
        nproc=2,
        cwd=tmp_path,
    )
    ref, got = read_metrics(one), read_metrics(zbv)
    assert [r["step"] for r in ref if "eval_loss" in r] == [1, 2]
    for x, y in zip(ref, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
        assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)
        assert y["eval_tokens"] == x["eval_tokens"]
