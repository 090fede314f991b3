"""MindSpeed-LLM configs of the shapes its own FSDP2 examples and tests use, through the importer.

Each case is a small YAML written here in the shape of a MindSpeed file (grouped keys), never a
copy of one. The expectations are MindSpeed's own behaviour (`config/mindspeed_args.py` names the
version it was read from).
"""

from __future__ import annotations

from typing import Any

import pytest

from meshforge.config import ConfigError, load_config
from meshforge.config.loader import dump_yaml, load_native_dict, validate_imported
from meshforge.config.mindspeed_args import ARGUMENTS, BY_NAME, REQUIRED, MsArg, as_bool
from meshforge.models.registry import SPECS, built_families

BASE = {
    "model": {"model_name_or_path": "/models/tiny", "model_id": "qwen3"},
    "training": {"output_dir": "./out", "max_steps": 3},
}


def _write(tmp_path, groups: dict[str, dict[str, Any]], name: str = "ms.yaml"):
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in BASE.items()}
    for group, keys in groups.items():
        merged.setdefault(group, {}).update(keys)
    path = tmp_path / name
    path.write_text(dump_yaml(merged), encoding="utf-8")
    return path


def _import(path, overrides=()) -> tuple[dict[str, Any], list[str]]:
    lines: list[str] = []
    origins: dict[str, tuple[str, Any]] = {}
    data, _, _ = load_native_dict(path, overrides, fmt="mindspeed", log=lines.append, origins=origins)
    validate_imported(data, origins, source=str(path))
    return data, lines


def _error(path) -> str:
    with pytest.raises(ConfigError) as err:
        _import(path)
    return str(err.value)


# --- save_steps / save_epochs ----------------------------------------------------------------


def test_save_steps_and_epochs_zero_save_nothing(tmp_path):
    path = _write(tmp_path, {"training": {"save_steps": 0, "save_epochs": 0}})
    data, lines = _import(path)
    assert data["checkpoint"]["enable_save"] is False
    assert "save_interleaved_steps" not in data["checkpoint"]
    assert "save_epochs" not in data["checkpoint"]
    assert any(line.startswith("save_steps/save_epochs: 0 and 0") for line in lines)


def test_save_steps_zero_alone_means_no_interval(tmp_path):
    cfg = load_config(_write(tmp_path, {"training": {"save_steps": 0}}))
    assert cfg.checkpoint.save_interleaved_steps is None
    assert cfg.checkpoint.enable_save is True
    assert cfg.checkpoint.save_epochs is None


def test_save_epochs_zero_with_an_interval(tmp_path):
    data, lines = _import(_write(tmp_path, {"training": {"save_steps": 5, "save_epochs": 0}}))
    assert data["checkpoint"]["save_interleaved_steps"] == 5
    assert "save_epochs" not in data["checkpoint"]
    assert any(line.startswith("save_epochs: 0 -> no epoch-end saves") for line in lines)


def test_negative_save_steps_is_no_interval_as_in_mindspeed(tmp_path):
    # MindSpeed saves when `save_steps > 0 and step % save_steps == 0`.
    cfg = load_config(_write(tmp_path, {"training": {"save_steps": -1}}))
    assert cfg.checkpoint.save_interleaved_steps is None


def test_no_interval_saves_only_the_last_step(tmp_path):
    from meshforge.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(
        save_dir=tmp_path, prefix="c", interval=None, keep=None, enabled=True, save_optimizer=True, rank=0
    )
    assert [s for s in range(1, 11) if manager.should_save(s, 10)] == [10]


# --- booleans ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "shuffle"), [(1, False), (0, True), ("yes", False), ("F", True)])
def test_mindspeed_booleans_take_what_its_parser_takes(tmp_path, given, shuffle):
    path = _write(tmp_path, {"training": {"disable_shuffling": given}})
    data, lines = _import(path)
    assert data["train_dataset"]["dataloader"]["shuffle"] is shuffle
    assert (
        f"disable_shuffling: {given!r} read as {not shuffle} (MindSpeed reads 1/0, yes/no, t/f as booleans)"
        in lines
    )


def test_a_boolean_mindspeed_cannot_read_is_an_error(tmp_path):
    text = _error(_write(tmp_path, {"training": {"disable_shuffling": 2}}))
    assert "disable_shuffling: must be a boolean" in text and "got 2" in text


def test_native_booleans_stay_strict(tmp_path):
    path = tmp_path / "native.yaml"
    path.write_text(
        "model:\n  model_type: qwen3\ntrain_dataset:\n  dataloader:\n    type: TextDataLoader\n    shuffle: 1\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "train_dataset.dataloader.shuffle" in str(err.value)


def test_as_bool_is_mindspeeds_string_to_bool():
    assert [as_bool(v) for v in (True, 1, "1", "Yes", "t", "Y", "true")] == [True] * 7
    assert [as_bool(v) for v in (False, 0, "0", "No", "f", "n", "FALSE")] == [False] * 7
    assert [as_bool(v) for v in (2, "maybe", 1.0, None, [])] == [None] * 5


# --- values and arguments meshforge does not build --------------------------------------------


def test_a_choice_mindspeed_has_but_meshforge_does_not_build(tmp_path):
    text = _error(_write(tmp_path, {"parallel": {"fsdp_implementation": "custom"}}))
    assert "error: fsdp_implementation: not supported yet: fsdp_implementation=custom" in text


def test_a_choice_mindspeed_does_not_have_stays_a_validation_error(tmp_path):
    text = _error(_write(tmp_path, {"parallel": {"fsdp_implementation": "fancy"}}))
    assert "not supported yet" not in text
    assert "parallelism.fsdp_implementation" in text and "from MindSpeed fsdp_implementation='fancy'" in text


def test_newer_arguments_are_not_supported_yet_not_unknown(tmp_path):
    path = _write(
        tmp_path, {"optimization": {"use_sparse_flash_attn": True, "use_fused_lightning_indexer": 1}}
    )
    text = _error(path)
    assert "optimization.use_sparse_flash_attn: not supported yet: use_sparse_flash_attn=True" in text
    assert "optimization.use_fused_lightning_indexer: not supported yet" in text
    assert "unknown" not in text


def test_newer_arguments_at_their_default_are_logged(tmp_path):
    _, lines = _import(_write(tmp_path, {"optimization": {"use_fused_lightning_indexer_loss": False}}))
    assert (
        "use_fused_lightning_indexer_loss = False: MindSpeed's default, no effect (not built in meshforge)"
        in lines
    )


def test_only_names_outside_the_list_are_unknown(tmp_path):
    text = _error(_write(tmp_path, {"optimization": {"use_sparse_flash_atn": True}}))
    assert "unknown MindSpeed argument 'use_sparse_flash_atn'; did you mean 'use_sparse_flash_attn'?" in text


def test_an_argument_in_the_wrong_group_names_its_group(tmp_path):
    text = _error(_write(tmp_path, {"training": {"use_sparse_flash_attn": False}}))
    assert "belongs to the 'optimization' group" in text


@pytest.mark.parametrize("model_id", ["deepseek4", "glm52", "longcat_flash_lite", "deepseek_v4"])
def test_model_ids_without_a_family(tmp_path, model_id):
    text = _error(_write(tmp_path, {"model": {"model_id": model_id}}))
    assert f"error: model_id: not supported yet: model family {model_id}" in text
    assert "built: " + ", ".join(built_families()) in text
    assert "generic transformers path" in text


@pytest.mark.parametrize("model_id", sorted(m for spec in SPECS for m in spec.model_ids))
def test_model_ids_with_a_family_import(tmp_path, model_id):
    data, _ = _import(_write(tmp_path, {"model": {"model_id": model_id}}))
    assert data["model"]["model_id"] == model_id


# --- every argument accounted for ----------------------------------------------------------------


def _non_default(arg: MsArg) -> Any:
    """A value of `arg` other than its default that MindSpeed would accept, or None when there is none."""
    default = None if arg.default is REQUIRED else arg.default
    if arg.kind == "bool":
        return not default
    if arg.kind == "choice":
        others = [c for c in arg.choices if c != default]
        return others[-1] if others else None
    if arg.kind == "int":
        return (default or 0) + 2
    if arg.kind == "float":
        return (default or 0.0) + 0.5
    if arg.kind == "list":
        return [3] if arg.name in ("profile_ranks", "chunk_mbs_arg_indexs") else ["model.layers.{*}.mlp"]
    if arg.kind == "dict_or_str":
        return {"file_name": "./data.json"}
    return f"/x/{arg.name}"


CASES = [arg for arg in ARGUMENTS if _non_default(arg) is not None]


def test_the_list_covers_every_group():
    assert {arg.group for arg in ARGUMENTS} == {
        "model",
        "data",
        "parallel",
        "training",
        "inference",
        "optimization",
    }
    assert len(CASES) >= len(ARGUMENTS) - 3  # only single-choice arguments have no other value
    assert BY_NAME["fsdp_implementation"].choices == ("custom", "native")


@pytest.mark.parametrize("arg", CASES, ids=[arg.name for arg in CASES])
def test_every_argument_with_a_non_default_value_is_logged_or_an_error(tmp_path, arg):
    value = _non_default(arg)
    path = _write(tmp_path, {arg.group: {arg.name: value}})
    try:
        _, lines = _import(path)
    except ConfigError as err:
        assert arg.name in str(err), str(err)
        return
    mentioned = [line for line in lines if arg.name in line.split(" -> ")[0].split(" = ")[0].split(":")[0]]
    assert mentioned, f"{arg.name}={value!r} is in no import line:\n" + "\n".join(lines)


def test_a_flat_file_with_an_unbuilt_argument_is_read_as_mindspeed(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("use_sparse_flash_attn: true\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "use_sparse_flash_attn: not supported yet: use_sparse_flash_attn=True" in str(err.value)
