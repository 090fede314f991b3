"""Step skipping and the consecutive-skip stop (`meshforge.train.health`), in one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshforge.monitor.config import HealthCheckpointConfig
from meshforge.train.health import StepHealth


def _health(*, written: bool, **fields: float) -> StepHealth:
    return StepHealth.from_monitor(
        HealthCheckpointConfig(**fields), written=written, device=torch.device("cpu")
    )


@pytest.mark.parametrize(("loss", "norm"), [(math.nan, 1.0), (1.0, math.inf), (math.inf, math.nan)])
def test_a_non_finite_step_is_skipped_without_the_section(loss: float, norm: float) -> None:
    verdict = _health(written=False).decide(loss, norm, None)
    assert verdict.skip
    assert verdict.reason.startswith("non-finite ")


def test_the_threshold_applies_only_when_the_section_is_written() -> None:
    assert not _health(written=False, global_norm_skip_threshold=5.0).decide(2.0, 50.0, None).skip
    verdict = _health(written=True, global_norm_skip_threshold=5.0).decide(2.0, 50.0, None)
    assert verdict.skip
    assert "global_norm_skip_threshold 5" in verdict.reason
    assert not _health(written=True, global_norm_skip_threshold=5.0).decide(2.0, 5.0, None).skip


def test_consecutive_skips_stop_and_an_applied_step_resets_the_count() -> None:
    health = _health(written=True, global_norm_skip_threshold=5.0, global_norm_skip_time=3)
    steps = [(1, 50.0), (2, 60.0), (3, 1.0), (4, 70.0), (5, math.nan), (6, 80.0)]
    stops = [health.record(health.decide(2.0, norm, None), step) for step, norm in steps]
    assert stops == [False, False, False, False, False, True]
    message = health.stop_message("/ckpt/checkpoint-00000006")
    assert message.startswith("monitor.health_checkpoint: 3 consecutive steps skipped (steps 4-6")
    assert "[70, nan, 80]" in message
    assert "weights after step 3" in message and message.endswith("/ckpt/checkpoint-00000006")


def test_skip_time_zero_stops_at_the_first_skip() -> None:
    health = _health(written=False, global_norm_skip_time=0)
    assert not health.record(health.decide(1.0, 1.0, None), 1)
    assert health.record(health.decide(math.nan, 1.0, None), 2)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(4, 3)
        self.proj = nn.Linear(3, 3)


def test_embedding_local_norm_and_its_warning() -> None:
    model = _Tiny()
    health = _health(written=True, embedding_local_norm_threshold=1.0)
    assert health.embedding_local_norm(model) is None  # no gradient yet
    model.embed_tokens.weight.grad = torch.full((4, 3), 0.5)
    norm = health.embedding_local_norm(model)
    assert norm == pytest.approx(math.sqrt(12 * 0.25), rel=1e-12)
    verdict = health.decide(1.0, 1.0, norm)
    assert not verdict.skip
    warning = health.embedding_warning(verdict, 7)
    assert warning is not None
    assert warning.startswith("warning: step 7: embedding local gradient norm 1.732 > ")
    assert "monitor.health_checkpoint.embedding_local_norm_threshold 1" in warning
    # Not measured (no cost) when the section is not written.
    assert _health(written=False).embedding_local_norm(model) is None
    quiet = _health(written=True, embedding_local_norm_threshold=10.0)
    assert quiet.embedding_warning(quiet.decide(1.0, 1.0, norm), 7) is None
