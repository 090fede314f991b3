"""The equality tests' measure (`tests/_compare.py`): rounding passes, a wrong tensor fails."""

from __future__ import annotations

import pytest
import torch

from tests._compare import assert_close, close_error, max_rel_error, rel_error


def _cancelling_sum() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head sums over 4096 terms that cancel to ~1e-3 of their size, as dt_bias's gradient
    does: float32 in two summation orders, and the float64 value."""
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(4096, 4, generator=g, dtype=torch.float64)
    terms -= terms.mean(0) * 0.999  # what is left is a small fraction of each term
    exact = terms.sum(0)
    forward = terms.float().sum(0)
    # Another order of the same float32 terms (two halves, as two ranks would sum them).
    halves = terms.float().view(2, 2048, 4).sum(1).sum(0)
    return forward, halves, exact


def test_norm_relative_error_is_scale_free_and_counts_every_element() -> None:
    want = torch.tensor([3.0, 4.0])
    assert rel_error(want * 1.5, want) == pytest.approx(0.5)
    assert rel_error(want * 1e-20 * 1.5, want * 1e-20) == pytest.approx(0.5)
    assert rel_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_error(torch.ones(3), torch.zeros(3)) == float("inf")
    assert max_rel_error(torch.tensor([3.0, 4.4]), want) == pytest.approx(0.1)
    with pytest.raises(AssertionError):
        rel_error(torch.ones(2), torch.ones(3))


def test_rounding_of_a_cancelling_sum_passes_only_against_float64() -> None:
    forward, halves, exact = _cancelling_sum()
    # Plain norm-relative 1e-5 cannot hold for such a sum on any layout ...
    assert rel_error(halves, forward) > 1e-5
    # ... but the other order is no further from float64 than a few times the reference's error.
    assert_close(halves, forward, want64=exact)


def test_a_wrong_gradient_fails_every_form() -> None:
    forward, halves, exact = _cancelling_sum()
    wrong = halves.clone()
    # One head off by 1 %: float32 itself resolves such a sum to ~1e-4 only (measured: the two
    # orders are 4e-5 apart, 0.2 of the allowed error), so this is as fine as it can tell.
    wrong[0] *= 1.01
    with pytest.raises(AssertionError, match="x allowed"):
        assert_close(wrong, forward, want64=exact)
    weights = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError):
        assert_close(weights * (1 + 3e-5), weights)
    assert_close(weights * (1 + 3e-6), weights)
    # A floor: below it a tensor counts as noise of a larger computation, above it it is relative.
    tiny = torch.full((4,), 1e-9)
    assert close_error(tiny * 2, tiny, floor=1e-3) < 1.0
    assert close_error(weights * 2, weights, floor=1e-3) > 1.0
