"""`parallelism.fault_tolerance`: validation names the key path; layouts it cannot combine with are refused."""

from __future__ import annotations

from typing import Any

import pytest

from meshforge.config import ConfigError, check_trainable, config_from_dict

BASE: dict[str, Any] = {
    "model": {"model_type": "qwen3"},
    "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
    "context": {"device_target": "cpu"},
}


def _cfg(ft: dict[str, Any], **par: Any) -> Any:
    return config_from_dict({**BASE, "parallelism": {"fault_tolerance": ft, **par}})


def test_defaults_are_off() -> None:
    ft = config_from_dict(BASE).parallelism.fault_tolerance
    assert ft.enable is False and ft.min_replicas == 1 and ft.replica_id is None and ft.lighthouse is None


@pytest.mark.parametrize(
    ("ft", "path", "words"),
    [
        (
            {"replica_id": 2, "replica_groups": 2},
            "parallelism.fault_tolerance.replica_id",
            "[0, replica_groups=2)",
        ),
        (
            {"min_replicas": 3, "replica_groups": 2},
            "parallelism.fault_tolerance.min_replicas",
            "cannot exceed",
        ),
        ({"timeout_s": 0}, "parallelism.fault_tolerance.timeout_s", ""),
        ({"lighthous": "x"}, "parallelism.fault_tolerance", "lighthous"),
    ],
)
def test_invalid_values_name_the_key(ft: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(ft)
    assert path in str(err.value) and words in str(err.value)


@pytest.mark.parametrize(
    "par",
    [{"pipeline_parallel": 2}, {"tensor_parallel": 2}, {"context_parallel": 2}, {"dense_fsdp_shard_size": 1}],
)
def test_layouts_that_do_not_combine_are_refused_by_name(par: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg({"enable": True}, **par)
    text = str(err.value)
    assert "parallelism.fault_tolerance.enable" in text and next(iter(par)) in text


def test_enabled_section_trains_and_refuses_per_rank_means() -> None:
    check_trainable(_cfg({"enable": True}))
    with pytest.raises(ConfigError) as err:
        check_trainable(_cfg({"enable": True}, disable_gradient_division=False))
    assert "parallelism.disable_gradient_division" in str(err.value)
