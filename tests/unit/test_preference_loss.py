"""Preference losses against a float64 hand computation of each formula (loss/preference.py)."""

from __future__ import annotations

import math

import pytest
import torch

from meshforge.loss.preference import PairLogps, PreferenceLoss, sequence_logps


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


PI = (-12.0, -20.0, -7.5)  # chosen, rejected, second chosen
PAIRS = PairLogps(
    chosen=torch.tensor([-12.0, -7.5], dtype=torch.float64),
    rejected=torch.tensor([-20.0, -6.0], dtype=torch.float64),
    chosen_tokens=torch.tensor([4, 3]),
    rejected_tokens=torch.tensor([5, 2]),
)
REF = PairLogps(
    chosen=torch.tensor([-13.0, -8.0], dtype=torch.float64),
    rejected=torch.tensor([-18.0, -6.5], dtype=torch.float64),
    chosen_tokens=torch.tensor([4, 3]),
    rejected_tokens=torch.tensor([5, 2]),
)


def _h(i: int, averaged: bool) -> float:
    c, r = PAIRS.chosen_tokens[i].item(), PAIRS.rejected_tokens[i].item()
    dc = (PAIRS.chosen[i] - REF.chosen[i]).item() / (c if averaged else 1)
    dr = (PAIRS.rejected[i] - REF.rejected[i]).item() / (r if averaged else 1)
    return dc - dr


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sigmoid_hinge_ipo_match_the_formulas(smoothing: float) -> None:
    beta = 0.2
    got, metrics = PreferenceLoss("sigmoid", beta, label_smoothing=smoothing)(PAIRS, REF)
    want = [
        -(1 - smoothing) * _logsig(beta * _h(i, False)) - smoothing * _logsig(-beta * _h(i, False))
        for i in (0, 1)
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    margins = [beta * _h(i, False) for i in (0, 1)]
    torch.testing.assert_close(metrics["rewards/margins"], torch.tensor(margins, dtype=torch.float64))
    assert metrics["rewards/accuracies"].tolist() == [1.0 if m > 0 else 0.0 for m in margins]
    hinge, _ = PreferenceLoss("hinge", beta)(PAIRS, REF)
    assert hinge.tolist() == pytest.approx([max(0.0, 1 - beta * _h(i, False)) for i in (0, 1)], abs=1e-12)
    ipo, _ = PreferenceLoss("ipo", beta)(PAIRS, REF)
    assert ipo.tolist() == pytest.approx([(_h(i, True) - 1 / (2 * beta)) ** 2 for i in (0, 1)], abs=1e-12)


def test_reference_free_losses_and_ftx() -> None:
    beta, gamma = 0.5, 0.3
    c = (PAIRS.chosen / PAIRS.chosen_tokens).tolist()
    r = (PAIRS.rejected / PAIRS.rejected_tokens).tolist()
    simpo, _ = PreferenceLoss("simpo", beta, simpo_gamma=gamma)(PAIRS, None)
    assert simpo.tolist() == pytest.approx(
        [-_logsig(beta * (a - b) - gamma) for a, b in zip(c, r)], abs=1e-12
    )
    orpo, _ = PreferenceLoss("orpo", beta)(PAIRS, None)
    odds = [(a - b) - (math.log1p(-math.exp(a)) - math.log1p(-math.exp(b))) for a, b in zip(c, r)]
    assert orpo.tolist() == pytest.approx([-a - beta * _logsig(o) for a, o in zip(c, odds)], abs=1e-12)
    plain, _ = PreferenceLoss("sigmoid", 0.1)(PAIRS, REF)
    ftx, _ = PreferenceLoss("sigmoid", 0.1, ftx=0.7)(PAIRS, REF)
    torch.testing.assert_close(ftx - plain, -0.7 * torch.tensor(c, dtype=torch.float64))


def test_equal_policy_and_reference_gives_ln2_and_sequence_logps_sum_answer_tokens() -> None:
    loss, _ = PreferenceLoss("sigmoid", 0.1)(PAIRS, PAIRS)
    torch.testing.assert_close(loss, torch.full((2,), math.log(2.0), dtype=torch.float64))
    logits = torch.randn(2, 4, 7, dtype=torch.float64)
    labels = torch.tensor([[-100, 3, 1, -100], [2, -100, -100, 5]])
    sums, counts = sequence_logps(logits, labels)
    logp = torch.log_softmax(logits, -1)
    want = [logp[0, 1, 3] + logp[0, 2, 1], logp[1, 0, 2] + logp[1, 3, 5]]
    torch.testing.assert_close(sums.double(), torch.stack(want), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [2, 2]
