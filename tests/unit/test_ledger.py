"""SavedTensorLedger: what autograd holds for backward, counted once per live storage."""

from __future__ import annotations

import gc

import torch

from meshforge.memory.ledger import SavedTensorLedger


class _OneAddress(SavedTensorLedger):
    """Every tensor at one address, as when the allocator hands a freed block out again."""

    def _key(self, tensor: torch.Tensor) -> int | None:
        return 7


def test_a_reused_address_counts_again_once_its_earlier_tensor_is_freed() -> None:
    ledger = _OneAddress()
    first = torch.zeros(16)
    ledger.add(first)
    ledger.add(first[:8])  # a view of a storage already counted, while it is alive
    assert ledger.device_bytes == 64
    del first
    gc.collect()
    ledger.add(torch.zeros(32))  # the same address, a new storage
    assert ledger.device_bytes == 64 + 128


def test_parameters_and_their_views_are_not_activations() -> None:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    ledger = SavedTensorLedger()
    ledger.exclude(layer.parameters())
    with ledger.recording():
        y = torch.tanh(layer(x))
    # linear saves x (not the weight); tanh saves its output
    assert ledger.device_bytes == x.numel() * 4 + y.numel() * 4
