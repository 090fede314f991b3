"""Real clients: Megatron-LM's and MindSpeed-LLM's own example scripts (tests/data/megatron_scripts)
import with the parallel degrees they set, or name each flag meshforge does not build."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshforge.config.base import ConfigError
from meshforge.config.loader import load_config, load_native_dict
from tests.conftest import meshforge_here
from tests.unit._megatron_scripts import filled


def _refused(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_native_dict(str(path))
    return str(err.value)


def test_mindspeed_qwen3_dense_and_moe_scripts_import_with_their_degrees(tmp_path: Path):
    dense = load_config(str(filled("mindspeed_qwen3_0point6b_pretrain.sh", tmp_path)))
    assert dense.model.model_type == "qwen3" and dense.parallelism.tensor_parallel == 1
    assert dense.training.global_batch_size == 32 and dense.training.steps == 2000
    assert dense.model.compute_dtype == "bfloat16"
    moe = load_config(str(filled("mindspeed_qwen3_30b_a3b_pretrain.sh", tmp_path)))
    assert moe.model.model_type == "qwen3_moe"
    assert (moe.parallelism.pipeline_parallel, moe.parallelism.expert_parallel) == (2, 8)
    assert moe.recompute.mode == "full"


def test_config_import_of_a_script_writes_native_yaml(tmp_path: Path):
    script = filled("mindspeed_qwen3_0point6b_pretrain.sh", tmp_path)
    proc = meshforge_here("config", "import", str(script), "-o", str(tmp_path / "out.yaml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "import: --tensor-model-parallel-size 1 -> parallelism.tensor_parallel: 1" in proc.stderr
    text = (tmp_path / "out.yaml").read_text()
    assert text.startswith(f"# Imported from {script} (Megatron-style launch script)")
    assert yaml.safe_load(text)["model"]["num_hidden_layers"] == 28
    assert load_config(str(tmp_path / "out.yaml")).parallelism.data_parallel_shard == -1


@pytest.mark.parametrize(
    ("name", "unbuilt"),
    [
        ("mindspeed_deepseek3_671b_pretrain.sh", ["--noop-layers", "--rope-scaling-type", "--expert-tensor-parallel-size", "--swap-optimizer"]),
        ("mindspeed_qwen3_0point6b_lora_tune.sh", ["--is-instruction-dataset", "--prompt-type", "--handler-name"]),
        ("megatron_llama3_8b_h100_fp8.sh", ["--apply-layernorm-1p", "--decoupled-lr", "--fp8-format", "--mock-data"]),
        ("megatron_mixtral_8x7b.sh", ["--tokenizer-type", "--num-experts"]),
        ("megatron_gpt3_175b.sh", ["--normalization", "--swiglu", "--position-embedding-type", "--vocab-file"]),
        ("megatron_mamba_train.sh", ["--hybrid-layer-pattern", "--tokenizer-type", "--position-embedding-type"]),
    ],
)  # fmt: skip
def test_scripts_of_unbuilt_features_name_each_flag(tmp_path: Path, name: str, unbuilt: list[str]):
    text = _refused(filled(name, tmp_path))
    assert [flag for flag in unbuilt if f"error: {flag}: not supported yet" not in text] == [], text


def test_meshforge_megatron_refuses_an_unknown_flag_with_a_suggestion(tmp_path: Path):
    proc = meshforge_here("megatron", "--num-layerz", "2", "--tensor-model-parallel-size", "1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "error: --num-layerz: unknown flag" in proc.stderr and "did you mean '--num-layers'" in proc.stderr


def test_the_shipped_example_script_imports():
    cfg = load_config(
        str(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "pretrain_qwen3_tiny.sh")
    )
    assert (
        cfg.model.model_type == "qwen3" and cfg.training.steps == 10 and cfg.training.global_batch_size == 16
    )
    assert cfg.training.output_dir == "output/megatron_qwen3_tiny"


def test_config_validate_reads_a_script_and_a_missing_training_line_names_the_lines(tmp_path: Path):
    script = filled("mindspeed_qwen3_30b_a3b_pretrain.sh", tmp_path)
    proc = meshforge_here("config", "validate", str(script), "--no-path-checks", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "import: --expert-model-parallel-size 8 -> parallelism.expert_parallel: 8" in proc.stderr
    broken = tmp_path / "broken.sh"
    broken.write_text((tmp_path / script.name).read_text().replace("pretrain_gpt.py", "evaluate_gpt.py"))
    proc = meshforge_here("config", "import", str(broken), cwd=tmp_path)
    assert proc.returncode == 2
    line = broken.read_text().splitlines().index("torchrun $DISTRIBUTED_ARGS evaluate_gpt.py \\") + 1
    assert (
        "no line runs a training entry point" in proc.stderr
        and f"looked at: line {line}: torchrun" in proc.stderr
    )
