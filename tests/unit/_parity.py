"""Helpers the model-family parity tests share (ours against transformers, same weights).

Each ``test_<family>.py`` builds a transformers model and ours from the same
``*Args``; these helpers load one into the other and compare outputs and gradients,
so the checks read the same in every family.
"""

from __future__ import annotations

from torch import nn

# The suite's one measure (norm of the error over the reference's norm, in float64), under the
# name the family tests import.
from tests._compare import rel_error as rel


def load_from_hf(ours: nn.Module, hf: nn.Module) -> nn.Module:
    """Load ``hf``'s weights into ``ours`` after checking both use exactly the same names."""
    hf_keys, our_keys = set(hf.state_dict()), set(ours.state_dict())
    assert hf_keys == our_keys, (hf_keys - our_keys, our_keys - hf_keys)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


def assert_grads_match(hf: nn.Module, ours: nn.Module, *, tol: float) -> None:
    """Every parameter of ``ours`` has a gradient within ``tol`` (norm-relative) of ``hf``'s same-named one."""
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for n, p in ours.named_parameters():
        assert p.grad is not None, n
        assert rel(p.grad, hf_grads[n]) <= tol, n
