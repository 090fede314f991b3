"""The global batch follows the world size unless a config fixes it; the shipped configs scale.

Without `training.global_batch_size` a step is one micro-batch per data-parallel rank (or
`gradient_accumulation_steps` of them), as torchtitan's and the HF Trainer's are; with it, the
layout must fit under it and the accumulation steps follow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.config import ConfigError, load_config
from meshforge.config.checks import world_size_issues
from meshforge.train.config import TrainingConfig

REPO = Path(__file__).resolve().parents[2]
#: The configs a user runs first (README): no global batch, so any process count fits.
FIRST_CONFIGS = ["configs/demo.yaml", "configs/qwen3/pretrain_megatron_tiny.yaml", "configs/llama/tiny.yaml"]


def test_local_batch_only_scales_the_global_batch_with_the_ranks() -> None:
    training = TrainingConfig(local_batch_size=16)
    assert training.global_batch_size is None
    assert [training.accumulation_steps(dp) for dp in (1, 2, 4)] == [1, 1, 1]
    assert [training.effective_global_batch_size(dp) for dp in (1, 2, 4)] == [16, 32, 64]
    accumulated = TrainingConfig(local_batch_size=2, gradient_accumulation_steps=3)
    assert accumulated.effective_global_batch_size(4) == 24


def test_a_fixed_global_batch_sets_the_accumulation_and_must_fit() -> None:
    training = TrainingConfig(local_batch_size=2, global_batch_size=8)
    assert [training.accumulation_steps(dp) for dp in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(
        ValueError, match=r"training.global_batch_size: 8 is smaller than data-parallel size 8"
    ):
        training.accumulation_steps(8)


def test_a_ramp_needs_the_global_batch_it_ends_at() -> None:
    with pytest.raises(
        ConfigError, match="training.rampup_batch_size: the ramp ends at training.global_batch_size"
    ):
        load_config(str(REPO / "configs" / "demo.yaml"), ["--training.rampup_batch_size=[16, 16, 100]"])


#: Every runnable shipped config (the real-size examples are planned for their own clusters).
SHIPPED = sorted(
    str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml") if "examples" not in p.parts
)


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_configs_fit_one_two_and_four_processes(config: str) -> None:
    cfg = load_config(str(REPO / config), [])
    for world in (1, 2, 4):
        errors, _ = world_size_issues(cfg, world)
        assert errors == [], (world, errors)


def test_both_sizes_given_are_checked_against_the_world_size() -> None:
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), ["--training.global_batch_size=16"])
    errors, _ = world_size_issues(cfg, 2)
    assert [key for key, _ in errors] == ["training.global_batch_size"]
    assert "data-parallel size 2 x local_batch_size 16" in errors[0][1]


def test_gradient_accumulation_and_a_global_batch_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        load_config(
            str(REPO / "configs" / "demo.yaml"),
            ["--training.global_batch_size=32", "--training.gradient_accumulation_steps=2"],
        )
