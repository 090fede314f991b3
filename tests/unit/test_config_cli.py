"""`meshforge config ...` sub-commands: exit codes, messages without tracebacks, schema, show, import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.cli.config import main
from meshforge.config import config_from_dict, load_config
from meshforge.config.loader import parse_yaml

FIXTURES = Path(__file__).parent / "fixtures"
GOOD = (
    "model:\n  model_type: qwen3\n  num_hidden_layers: 2\ntraining:\n  steps: 3\n  global_batch_size: 4\n"
    "train_dataset:\n  dataloader:\n    type: TextDataLoader\n"
    "    data_path: meshforge://assets/corpus/python_docstrings.jsonl\n    seq_length: 8\n"
)


def _write(tmp_path, text: str, name: str = "train.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_validate_ok(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, GOOD)]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_error_exit_2_without_traceback(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, "training:\n  global_batch_size: -4\n")]) == 2
    err = capsys.readouterr().err
    assert "error: training.global_batch_size: must be positive, got -4" in err
    assert "Traceback" not in err


def test_validate_refuses_what_train_refuses_and_warns_of_no_ops(tmp_path, capsys):
    # `train` stops at a feature not built yet: `validate` says so with the same exit code.
    path = _write(tmp_path, GOOD + "parallelism:\n  enable_mc2: true\n")
    assert main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "error: parallelism.enable_mc2: not supported yet: parallelism.enable_mc2" in err
    noop = _write(
        tmp_path, GOOD + "context:\n  device_target: cpu\nparallelism:\n  cpu_offload: true\n", "noop.yaml"
    )
    assert main(["validate", noop]) == 0
    assert "warning: parallelism.cpu_offload: no effect on cpu" in capsys.readouterr().err


def test_validate_world_size(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    assert main(["validate", path, "--world-size", "4"]) == 0
    assert main(["validate", path, "--world-size", "8"]) == 2
    assert "error: training.global_batch_size:" in capsys.readouterr().err
    tp = _write(tmp_path, GOOD + "parallelism:\n  tensor_parallel: 3\n", "tp.yaml")
    assert main(["validate", "--world-size", "4", tp]) == 2
    assert "error: parallelism" in capsys.readouterr().err


def test_validate_with_overrides(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    assert main(["validate", path, "--training.steps=0"]) == 2
    assert "error: training.steps: must be >= 1" in capsys.readouterr().err


def test_validate_missing_file(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_validate_mindspeed_file_and_forced_format(tmp_path, capsys):
    # The fixture names the model and data folders of the machine it was written for.
    assert main(["validate", str(FIXTURES / "mindspeed" / "qwen3_sft_grouped.yaml"), "--no-path-checks"]) == 0
    err = capsys.readouterr().err
    assert "import: tp_size -> parallelism.tensor_parallel = 1" in err
    assert "import: recompute -> recompute.mode = 'full'" in err
    assert "not supported yet: recompute" not in err
    native_looking = _write(tmp_path, "model:\n  model_name_or_path: /m\n")
    assert main(["validate", native_looking, "--format", "mindspeed", "--no-path-checks"]) == 0
    assert "MindSpeed-LLM format" in capsys.readouterr().err


def test_validate_layers_from_config_json(tmp_path, capsys):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    text = f"model:\n  model_name_or_path: {model_dir}\nrecompute:\n  mode: full\n  full_recompute_layer: ['0-4']\n"
    assert main(["validate", _write(tmp_path, text)]) == 2
    assert (
        "recompute.full_recompute_layer[0]: layer spec '0-4' is out of range [0, 3]"
        in capsys.readouterr().err
    )


def test_show_resolves_defaults_and_overrides(tmp_path, capsys):
    assert main(["show", _write(tmp_path, GOOD), "--training.seed=5"]) == 0
    shown = parse_yaml(capsys.readouterr().out)
    assert shown["training"]["seed"] == 5 and shown["checkpoint"]["save_max"] == 5
    assert shown["model"]["num_hidden_layers"] == 2
    assert config_from_dict(shown) == load_config(_write(tmp_path, GOOD), ["--training.seed=5"])


def test_schema(tmp_path, capsys):
    out = tmp_path / "schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    schema = json.loads(out.read_text())
    props = schema["properties"]
    for section in (
        "checkpoint",
        "training",
        "parallelism",
        "optimizer",
        "lr_scheduler",
        "train_dataset",
        "model",
        "monitor",
        "context",
        "profiler",
        "recompute",
        "recompute_comm",
        "swap",
        "callbacks",
        "lora_config",
        "kernels",
        "inference",
    ):
        assert section in props, section
    assert schema["additionalProperties"] is False
    defs = schema["$defs"]
    assert defs["TrainingConfig"]["additionalProperties"] is False
    assert defs["ModelConfig"].get("additionalProperties", True) is not False
    missing = [
        f"{name}.{field}"
        for name, model in defs.items()
        for field, spec in model.get("properties", {}).items()
        if not spec.get("description")
    ]
    assert missing == []
    # Top-level sections: described on the property or (pydantic drops a duplicate) on the referenced model.
    for name, prop in props.items():
        ref = prop.get("$ref", "").rsplit("/", 1)[-1]
        assert prop.get("description") or defs.get(ref, {}).get("description"), name
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "meshforge training config"


def test_import_prints_native_yaml(tmp_path, capsys):
    out = tmp_path / "native.yaml"
    assert main(["import", str(FIXTURES / "mindspeed" / "pretrain_flat.yaml"), "-o", str(out)]) == 0
    assert "max_steps -> training.steps = 100" in capsys.readouterr().err
    native = load_config(out)
    assert (
        native.training.steps == 100
        and native.train_dataset.dataloader.type == "BlendedMegatronDatasetDataLoader"
    )
    assert native == load_config(FIXTURES / "mindspeed" / "pretrain_flat.yaml")


def test_import_unknown_key_exit_2(tmp_path, capsys):
    # `learning_rate` is LLaMA-Factory's (tests/unit/test_llamafactory_import.py); no list has this one.
    assert main(["import", _write(tmp_path, "model_name_or_path: /m\nlearning_rat: 1.0\n")]) == 2
    assert "error: learning_rat: unknown MindSpeed argument" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "code"), [(GOOD, 0), ("training:\n  steps: x\n", 2)])
@pytest.mark.procs
def test_module_entry_point_subprocess(tmp_path, text, code):
    path = _write(tmp_path, text)
    proc = subprocess.run(
        [sys.executable, "-m", "meshforge.cli.config", "validate", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    if code:
        assert "error: training.steps:" in proc.stderr


def test_ascend_only_knob_warns_on_cpu(tmp_path, capsys):
    path = _write(tmp_path, GOOD + "context:\n  device_target: cpu\n  max_device_memory: 30GB\n")
    assert main(["validate", path]) == 0
    assert (
        "warning: context.max_device_memory: Ascend-only setting, no effect on device 'cpu'"
        in capsys.readouterr().err
    )
