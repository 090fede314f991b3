"""`parallelism.disable_gradient_division`: what each rank divides its loss sum by."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from meshforge.train.trainer import Trainer


def _fake(disable: bool, dp: int) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(parallelism=SimpleNamespace(disable_gradient_division=disable)),
        run=SimpleNamespace(
            env=SimpleNamespace(dims=SimpleNamespace(cp=1, dp=dp), device=torch.device("cpu"))
        ),
    )


def test_default_divides_by_the_global_token_count() -> None:
    global_tokens = torch.tensor(70.0)
    assert Trainer._loss_normalizer(_fake(True, 2), 30, global_tokens) is global_tokens


def test_rank_mean_divides_by_own_tokens_times_data_ranks() -> None:
    # Two data ranks with 30 and 40 valid tokens: each takes its own mean, halved, so the
    # summed objective is (L0 / 30 + L1 / 40) / 2, the mean of the per-rank means.
    got = [Trainer._loss_normalizer(_fake(False, 2), n, torch.tensor(70.0)) for n in (30, 40)]
    assert [float(x) for x in got] == [60.0, 80.0]
    # A rank with no valid token divides by the data-rank count, not by zero.
    assert float(Trainer._loss_normalizer(_fake(False, 2), 0, torch.tensor(70.0))) == 2.0
