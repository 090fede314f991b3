"""`optimizer.accumulate_allreduce_grads_in_fp32`: the dtype a step's micro-batch gradients add up
and reduce in, alone (`GradAccumulation`) and through the trainer in bf16 (one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.config import check_trainable, config_from_dict
from meshforge.optim.grad_accum import GradAccumulation, low_precision_dtype, reduce_dtype_for
from tests._bf16_runs import grad_dtypes, grad_error, run

BF16, FP32 = torch.bfloat16, torch.float32


def _micro_grads(n: int, shape: tuple[int, ...] = (64, 64)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # Same-sign values of similar size: a bf16 running sum loses low bits at every add.
    return [(torch.rand(shape, generator=gen) + 1.0).to(BF16) for _ in range(n)]


def _accumulate(accum: GradAccumulation, p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    for g in grads:
        # What autograd does for a leaf: add into .grad in the parameter's dtype.
        g = g.to(p.dtype)
        p.grad = g.clone() if p.grad is None else p.grad + g
        accum.after_micro_batch()
    accum.finish()


def test_bf16_parameters_sum_in_fp32_and_round_once() -> None:
    grads = _micro_grads(16)
    exact = torch.stack([g.double() for g in grads]).sum(0)
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=BF16))
    accum = GradAccumulation([p], fp32=True, params_dtype=BF16, compute_dtype=BF16)
    assert accum.mode == "buffer" and "float32 buffers" in accum.describe()
    _accumulate(accum, p, grads)
    assert p.grad is not None and p.grad.dtype == BF16 and accum.buffers() == []
    # The fp32 sum of bf16 values is exact here (16 values of 8 bits); one rounding at the end.
    assert torch.equal(p.grad, exact.to(BF16))

    q = torch.nn.Parameter(torch.zeros(64, 64, dtype=BF16))
    off = GradAccumulation([q], fp32=False, params_dtype=BF16, compute_dtype=BF16)
    assert not off.active  # autograd's own bf16 accumulation
    _accumulate(off, q, grads)
    running = grads[0].clone()
    for g in grads[1:]:
        running = running + g
    assert q.grad is not None and torch.equal(q.grad, running)
    err_fp32 = float((p.grad.double() - exact).norm() / exact.norm())
    err_bf16 = float((q.grad.double() - exact).norm() / exact.norm())
    assert err_fp32 < 2**-8 and err_fp32 < err_bf16 / 2


def test_fp32_parameters_with_bf16_compute() -> None:
    grads = _micro_grads(16)
    p = torch.nn.Parameter(torch.zeros(64, 64))
    on = GradAccumulation([p], fp32=True, params_dtype=FP32, compute_dtype=BF16)
    assert not on.active  # gradients already reach the fp32 parameters in fp32
    _accumulate(on, p, grads)
    assert p.grad is not None and p.grad.dtype == FP32
    assert torch.equal(p.grad, torch.stack([g.float() for g in grads]).sum(0))

    q = torch.nn.Parameter(torch.zeros(64, 64))
    low = GradAccumulation([q], fp32=False, params_dtype=FP32, compute_dtype=BF16)
    assert low.mode == "round" and "accumulate in torch.bfloat16" in low.describe()
    _accumulate(low, q, grads)
    running = grads[0].clone()
    for g in grads[1:]:
        running = running + g  # a bf16 buffer's sum
    assert q.grad is not None and q.grad.dtype == FP32 and torch.equal(q.grad, running.float())


def test_all_fp32_is_untouched_and_reduce_dtypes() -> None:
    assert not GradAccumulation([], fp32=False, params_dtype=FP32, compute_dtype=FP32).active
    assert low_precision_dtype(FP32, FP32) is None and low_precision_dtype(BF16, FP32) == BF16
    assert low_precision_dtype(FP32, torch.float16) == torch.float16
    assert reduce_dtype_for(FP32, fp32=True, params_dtype=FP32, compute_dtype=BF16) == FP32
    assert reduce_dtype_for(FP32, fp32=False, params_dtype=FP32, compute_dtype=BF16) == BF16
    assert reduce_dtype_for(FP32, fp32=False, params_dtype=FP32, compute_dtype=FP32) == FP32
    # parallelism.reduce_dtype: bf16 is kept with the default flag.
    assert reduce_dtype_for(BF16, fp32=True, params_dtype=FP32, compute_dtype=BF16) == BF16


def test_false_is_trainable() -> None:
    cfg = config_from_dict(
        {
            "model": {"model_type": "qwen3"},
            "optimizer": {"accumulate_allreduce_grads_in_fp32": False},
            "train_dataset": {
                "dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}
            },
        }
    )
    check_trainable(cfg)


@pytest.mark.slow
def test_bf16_training_through_the_trainer(tiny_config: Path, tmp_path: Path) -> None:
    """Five tiny runs (2 steps of 8 micro-batches): fp32, and bf16 with each accumulation dtype.

    Tolerance: bf16 keeps 8 significant bits (relative rounding up to 2^-9 ~ 2e-3 per value),
    but the loss is a mean over 256 tokens computed in fp32 and the weights move by lr 3e-3
    per step, so the bf16 losses stay within 2e-3 relative of the fp32 ones (measured: ~1e-4).
    """
    runs = {
        name: run(tiny_config, tmp_path, name, steps=2)
        for name in ("fp32", "b_fp32acc", "b_bf16acc", "m_fp32acc", "m_bf16acc")
    }
    ref = runs["fp32"]
    for name, r in runs.items():
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3), name
        assert len(r["losses"]) == 2
    # The optimizer's gradients: the parameter's dtype (torch keeps .grad in it).
    assert grad_dtypes(runs["b_fp32acc"]) == {BF16} and grad_dtypes(runs["m_fp32acc"]) == {FP32}
    assert any("float32 buffers" in line for line in runs["b_fp32acc"]["logs"])
    assert any("accumulate in torch.bfloat16" in line for line in runs["m_bf16acc"]["logs"])
    # fp32 accumulation is closer to the fp32 run's gradient than bf16 accumulation, for bf16
    # parameters and for fp32 parameters computed in bf16.
    for kind in ("b", "m"):
        close, far = grad_error(runs[f"{kind}_fp32acc"], ref), grad_error(runs[f"{kind}_bf16acc"], ref)
        assert close < far, (kind, close, far)
        assert close < 2e-2, (kind, close)
