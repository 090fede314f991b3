"""The three loss formulations (`meshforge.loss.lm`): same sums and gradients, no full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.loss.cross_entropy import IGNORE_INDEX
from meshforge.loss.lm import LMLoss, fused_chunk_size
from tests._compare import assert_close

N, H, V = 300, 24, 160


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.2).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    """Loss and gradients in float64 through the plain formula."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _run(loss_fn: LMLoss, hidden, weight, labels, scale: float = 0.25):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    if loss_fn.needs_hidden:
        loss = loss_fn(h, labels, w)
    else:
        loss = loss_fn(h @ w.T, labels)
    (loss * scale).backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), h.grad / scale, w.grad / scale


@pytest.mark.parametrize(
    "loss_fn",
    [LMLoss(), LMLoss("chunked", 64), LMLoss("fused", 64), LMLoss("fused", 1000), LMLoss("fused", 7)],
    ids=["logits", "chunked", "fused", "fused-one-chunk", "fused-odd-chunk"],
)
def test_every_formulation_matches_float64(loss_fn: LMLoss) -> None:
    hidden, weight, labels = _inputs()
    ref_loss, ref_h, ref_w = _reference(hidden, weight, labels)
    loss, grad_h, grad_w = _run(loss_fn, hidden, weight, labels)
    assert loss.dtype == torch.float32
    assert_close(loss.double(), ref_loss, rtol=1e-6)
    assert_close(grad_h.double(), ref_h, rtol=1e-5)
    assert_close(grad_w.double(), ref_w, rtol=1e-5)
    # Ignored rows get no gradient.
    assert grad_h[labels == IGNORE_INDEX].abs().max() == 0


def test_fused_under_bf16_autocast_matches_the_plain_bf16_path() -> None:
    hidden, weight, labels = _inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _run(LMLoss(), hidden, weight, labels)
        fused = _run(LMLoss("fused", 50), hidden, weight, labels)
    ref = _reference(hidden, weight, labels)
    for ours, theirs, exact in zip(fused, plain, ref, strict=True):
        # Both round the head's matmul to bfloat16: equally close to the float64 answer.
        err_fused = (ours.double() - exact).norm() / exact.norm()
        err_plain = (theirs.double() - exact).norm() / exact.norm()
        assert err_fused < max(2 * err_plain, 1e-3)


def test_fused_without_grad_mode_computes_the_loss_only() -> None:
    hidden, weight, labels = _inputs(2)
    with torch.no_grad():
        loss = LMLoss("fused", 64)(hidden.requires_grad_(), labels, weight.requires_grad_())
    assert not loss.requires_grad
    assert_close(loss.double(), _reference(hidden, weight, labels)[0], rtol=1e-6)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("mode", ["fused", "chunked"])
def test_no_full_vocabulary_logits_in_forward_or_backward(mode: str) -> None:
    hidden, weight, labels = _inputs(3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    chunk = 32
    with _LargestOutput() as seen:
        LMLoss(mode, chunk)(h, labels, w).backward()  # type: ignore[arg-type]
    # The largest tensors are one chunk's logits or a gradient ([N, H], [V, H]), never [N, V].
    assert seen.largest <= max(chunk * V, V * H, N * H) < N * V
    with _LargestOutput() as plain:
        F.cross_entropy(h @ w.T, labels, reduction="sum").backward()
    assert plain.largest >= N * V  # the check sees full logits where they exist


@pytest.mark.parametrize("mode", ["logits", "fused", "chunked"])
def test_compiled_loss_steps_match_eager(mode: str) -> None:
    torch._dynamo.reset()
    hidden, weight, labels = _inputs(4)
    chunk = None if mode == "logits" else 128  # 300 tokens: two full chunks and a short one
    eager = _run(LMLoss(mode, chunk), hidden, weight, labels)  # type: ignore[arg-type]
    compiled = _run(LMLoss(mode, chunk, "aot_eager"), hidden, weight, labels)  # type: ignore[arg-type]
    for a, b in zip(compiled, eager, strict=True):
        assert_close(a, b, rtol=1e-6)


@pytest.mark.procs  # inductor compiles its C++ kernels in processes
def test_inductor_fused_loss_matches_float64_and_recompiles_once_for_the_short_chunk() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss_fn = LMLoss("fused", 128, "inductor")
    for seed in range(3):  # the same shapes again: no new graph
        hidden, weight, labels = _inputs(5 + seed)
        loss, grad_h, grad_w = _run(loss_fn, hidden, weight, labels)
        ref = _reference(hidden, weight, labels)
        assert_close(loss.double(), ref[0], rtol=1e-6)
        assert_close(grad_h.double(), ref[1], rtol=1e-5)
        assert_close(grad_w.double(), ref[2], rtol=1e-5)
    # Full chunks of 128 and the last one of 44 tokens: the second shape compiles once more.
    assert counters["stats"]["unique_graphs"] <= 2


def test_fused_chunk_size_rule() -> None:
    assert fused_chunk_size(151_936) == 512
    assert fused_chunk_size(32_000) == 2097
    assert fused_chunk_size(8192) == 8192
    assert fused_chunk_size(1) == 8192


def test_describe_and_validation() -> None:
    assert LMLoss().describe() == "full-logits loss"
    assert (
        LMLoss("fused", 512, "inductor").describe()
        == "fused linear cross-entropy (512 tokens per chunk, compiled)"
    )
    with pytest.raises(ValueError, match="kernels.chunk_loss_size"):
        LMLoss("fused", None)
    with pytest.raises(ValueError, match="head_weight"):
        LMLoss("fused", 8)(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
