"""MindSpeed's `recompute` / `recompute_modules` and Megatron's recompute flags through the importer.

Megatron's meaning: `full` + `block` recomputes the first `recompute_num_layers` layers,
`full` + `uniform` every layer, `selective` the core attention; its rules: `full` needs a method
and a layer count, `selective` takes neither. The imported config loads, and trains.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshforge.config import ConfigError, config_from_dict
from meshforge.config.importer import import_mindspeed

BASE: dict[str, Any] = {"model_name_or_path": "/m", "output_dir": "/o", "dataset": "alpaca_en"}


def _imported(**keys: Any) -> tuple[dict[str, Any], list[str]]:
    lines: list[str] = []
    native = import_mindspeed({**BASE, **keys}, log=lines.append)
    return native.get("recompute", {}), lines


def test_mindspeed_recompute_and_modules() -> None:
    rec, _ = _imported(recompute=True, recompute_modules=["model.layers.{0-3}"])
    assert rec == {"mode": "full", "modules": ["model.layers.{0-3}"]}
    rec, _ = _imported(recompute=True)
    assert rec == {"mode": "full", "modules": ["model.layers.{*}"]}
    rec, lines = _imported(recompute=False, recompute_modules=["model.layers.{*}"])
    assert rec == {"mode": "None"} and any("recompute_modules -> unused" in line for line in lines)


def test_megatron_full_block_is_the_first_layers() -> None:
    rec, _ = _imported(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)
    assert rec == {"mode": "full", "full_recompute_layer": ["0-2"]}
    rec, _ = _imported(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert rec == {"mode": "full", "full_recompute_layer": ["0"]}


def test_megatron_full_uniform_is_every_layer() -> None:
    rec, lines = _imported(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert rec == {"mode": "full", "modules": ["model.layers.{*}"]}
    assert any("groups of 2" in line for line in lines)


def test_megatron_selective_is_the_core_attention() -> None:
    rec, _ = _imported(parallel={"recompute_granularity": "selective"})
    assert rec == {"mode": "full", "modules": ["model.layers.{*}.self_attn"], "exclude_op": ["matmul"]}
    config_from_dict({"model": {"model_type": "qwen3"}, "recompute": rec})


@pytest.mark.parametrize(
    ("keys", "where", "words"),
    [
        ({"recompute_granularity": "full"}, "recompute_method", "needs 'uniform' or 'block'"),
        (
            {"recompute_granularity": "full", "recompute_method": "block"},
            "recompute_num_layers",
            "positive integer",
        ),
        (
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 0},
            "recompute_num_layers",
            "positive integer",
        ),
        (
            {"recompute_granularity": "selective", "recompute_method": "uniform"},
            "recompute_method",
            "only with",
        ),
        ({"recompute_granularity": "some"}, "recompute_granularity", "'full' or 'selective'"),
        ({"recompute_method": "block", "recompute_num_layers": 2}, "recompute_granularity", "got None"),
        ({"recompute": True, "recompute_granularity": "selective"}, "recompute", "not both"),
    ],
)
def test_megatron_rules(keys: dict[str, Any], where: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        import_mindspeed({**BASE, **keys})
    assert any(path == where and words in reason for path, reason in err.value.issues), err.value.issues


def test_block_beyond_the_model_fails_at_load() -> None:
    rec, _ = _imported(recompute_granularity="full", recompute_method="block", recompute_num_layers=5)
    with pytest.raises(ConfigError, match=r"recompute.full_recompute_layer\[0\]: .*out of range \[0, 3\]"):
        from meshforge.config import check_trainable

        check_trainable(
            config_from_dict(
                {
                    "model": {"model_type": "qwen3", "num_hidden_layers": 4},
                    "train_dataset": {
                        "dataloader": {"type": "TextDataLoader", "data_path": "x", "seq_length": 8}
                    },
                    "recompute": rec,
                }
            )
        )
