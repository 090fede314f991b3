"""Per-sequence log-probabilities of pair rows (loss/sequence_logps.py) against a float64 loop."""

from __future__ import annotations

import pytest
import torch

from meshforge.loss.sequence_logps import sequence_logps


def _pair_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows, width, hidden, vocab = 3, 14, 8, 11
    segment_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -100)
    # (chosen length, rejected length, prompt length) per row; row 2 has a truncated-away prompt.
    for r, (c, j, p) in enumerate([(6, 5, 2), (4, 7, 3), (5, 4, 0)]):
        segment_ids[r, :c] = 1
        segment_ids[r, c : c + j] = 2
        unshifted = torch.full((width + 1,), -100)
        unshifted[p:c] = torch.randint(0, vocab, (c - p,), generator=g)
        unshifted[c + p : c + j] = torch.randint(0, vocab, (j - p,), generator=g)
        labels[r] = unshifted[1:]
    h = torch.randn(rows, width, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    return h, w, labels, segment_ids


def _reference(h, w, labels, segment_ids):
    logp = torch.log_softmax(h @ w.T, dim=-1)
    rows, width = labels.shape
    sums = torch.zeros(rows, 2, dtype=torch.float64)
    counts = torch.zeros(rows, 2, dtype=torch.long)
    for r in range(rows):
        for i in range(width - 1):
            s = int(segment_ids[r, i])
            if s and labels[r, i] != -100 and segment_ids[r, i + 1] == s:
                sums[r, s - 1] = sums[r, s - 1] + logp[r, i, labels[r, i]]
                counts[r, s - 1] += 1
    return sums, counts


@pytest.mark.parametrize("mode", ["logits", "hidden"])
def test_sequence_logps_values_and_gradients_equal_a_float64_loop(mode):
    h, w, labels, seg = _pair_batch()
    weights = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    expected, expected_counts = _reference(ref_h, ref_w, labels, seg)
    (expected * weights).sum().backward()
    got_h, got_w = h.float().requires_grad_(), w.float().requires_grad_()
    if mode == "logits":
        sums, counts, present = sequence_logps(got_h @ got_w.T, labels, seg)
    else:
        sums, counts, present = sequence_logps(got_h, labels, seg, head_weight=got_w, chunk_size=4)
    assert present.tolist() == [True, True, True]
    (sums * weights.float()).sum().backward()
    assert torch.equal(counts, expected_counts) and expected_counts[2].tolist() == [4, 3]

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert rel(sums.detach(), expected.detach()) < 1e-6
    assert rel(got_h.grad, ref_h.grad) < 1e-6
    assert rel(got_w.grad, ref_w.grad) < 1e-6
