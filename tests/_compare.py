"""Float comparisons for the equality tests that hold on any x86 CPU.

A parallel layout sums the same terms in another order, so its result differs from one process's
by rounding only; which kernels a CPU picks (AVX2, AVX-512, oneDNN or not) changes the last bits
of both. The measure is the error's norm relative to the reference's norm, computed in float64:
unlike an elementwise or max-abs bound it does not single out one tiny element, and a tensor
that is wrong (a missing all-reduce, a gradient left unscaled, a slice of the wrong rank) is off
by a large fraction of its norm, far above 1e-5.

Some gradients are sums that cancel to a small fraction of their terms (qwen3_next's `dt_bias`:
each token's contribution is larger than the total). Their float32 rounding error is large
relative to the result on any layout; `assert_close` takes a float64 reference for them, and then
bounds the error by a few times what one float32 process itself is off by.
"""

from __future__ import annotations

import torch

RTOL = 1e-5
# How many times one float32 process's own error (against float64) a layout may be off by.
ROUNDING_FACTOR = 8.0


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to(torch.float64)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got - want‖ / ‖want‖`` in float64 (DTensors gathered); 0 when both are zero."""
    a, b = _plain(got), _plain(want)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    diff = (a - b).norm().item()
    scale = b.norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest elementwise error relative to ``want``'s largest magnitude, in float64.

    A second bound beside the norm for results whose every element matters on its own (trained
    weights); not for gradients, whose small elements are rounding-sized on any layout.
    """
    a, b = _plain(got), _plain(want)
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def close_error(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    rtol: float = RTOL,
    want64: torch.Tensor | None = None,
    floor: float = 0.0,
) -> float:
    """The error of ``got`` in units of what it may be (``<= 1`` passes).

    Without ``want64``: ``‖got - want‖ / (rtol * max(‖want‖, floor))``; ``floor`` is the norm below
    which a tensor counts as rounding noise of a larger computation (a gradient that one optimizer
    step on slightly different weights moves by more than its own size). With ``want64`` (the same quantity computed in
    float64 from the same inputs): ``‖got - want64‖`` over the larger of ``rtol * ‖want64‖`` and
    ``ROUNDING_FACTOR`` times ``‖want - want64‖``, the float32 reference's own rounding error.
    """
    if want64 is None:
        a, b = _plain(got), _plain(want)
        assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
        diff, bound = (a - b).norm().item(), rtol * max(b.norm().item(), floor)
        if bound == 0.0:
            return 0.0 if diff == 0.0 else float("inf")
        return diff / bound
    a, b, exact = _plain(got), _plain(want), _plain(want64)
    assert a.shape == b.shape == exact.shape, (tuple(a.shape), tuple(b.shape), tuple(exact.shape))
    bound = max(rtol * exact.norm().item(), ROUNDING_FACTOR * (b - exact).norm().item())
    diff = (a - exact).norm().item()
    if bound == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / bound


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    rtol: float = RTOL,
    want64: torch.Tensor | None = None,
    floor: float = 0.0,
    what: object = "",
) -> None:
    """Fail unless ``got`` is within ``rtol`` of ``want`` by norm (see ``close_error``)."""
    err = close_error(got, want, rtol=rtol, want64=want64, floor=floor)
    assert err <= 1.0, (what, f"norm-relative error {rel_error(got, want):.3e}", f"{err:.2f} x allowed")


def assert_scalar_close(got: float, want: float, *, rtol: float = RTOL, what: object = "") -> None:
    """``|got - want| <= rtol * |want|`` for logged numbers (loss, grad norm)."""
    assert abs(got - want) <= rtol * abs(want), (what, got, want, abs(got - want) / max(abs(want), 1e-300))
