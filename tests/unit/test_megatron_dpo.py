"""MindSpeed-LLM's DPO launch flags (`posttrain_gpt.py --stage dpo ...`) through the script importer."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.config.base import ConfigError
from meshforge.config.loader import validate_imported
from meshforge.config.megatron_import import import_launch_script
from tests.unit.test_megatron_import import DENSE, _hf_folder

SCRIPT = """#!/bin/bash
# The shape of MindSpeed-LLM's examples/mcore/*/dpo_*.sh, on a tiny Qwen3 folder.
CKPT_LOAD_DIR="{load}"
GPT_ARGS="
    {dense} \\
    --load ${{CKPT_LOAD_DIR}} \\
    --finetune
"
RL_ARGS="
    --stage dpo \\
    --dpo-beta 0.25 \\
    --dpo-loss-type {loss} \\
    --dpo-label-smoothing 0.1 \\
    --pref-ftx 0.05 \\
    {extra}
"
torchrun --nproc_per_node 2 posttrain_gpt.py \\
    $GPT_ARGS \\
    $RL_ARGS \\
    --distributed-backend nccl
"""


def _script(tmp_path: Path, loss: str = "sigmoid", extra: str = "") -> tuple[Path, Path]:
    load = _hf_folder(tmp_path / "qwen3_tiny")
    path = tmp_path / "dpo_qwen3_tiny.sh"
    path.write_text(SCRIPT.format(load=load, dense=" ".join(DENSE), loss=loss, extra=extra), encoding="utf-8")
    return path, load


def test_a_dpo_launch_script_maps_to_the_preference_keys(tmp_path: Path):
    path, load = _script(tmp_path, extra=f"--ref-model {tmp_path / 'qwen3_tiny'}")
    lines: list[str] = []
    origins: dict[str, tuple[str, object]] = {}
    data = import_launch_script(str(path), lines.append, origins)
    validate_imported(data, origins)
    want = {
        "stage": "dpo",
        "pref_beta": 0.25,
        "pref_loss": "sigmoid",
        "dpo_label_smoothing": 0.1,
        "pref_ftx": 0.05,
    }
    assert {k: data["training"][k] for k in want} == want
    assert data["model"]["model_name_or_path"] == str(load)
    assert "--dpo-beta 0.25 -> training.pref_beta: 0.25" in lines
    assert any(line.startswith("--ref-model ") and "the policy's source" in line for line in lines)


def test_what_meshforge_does_not_build_is_named(tmp_path: Path):
    other = _hf_folder(tmp_path / "other")
    path, _ = _script(tmp_path, loss="ipo", extra=f"--ref-model {other} \\\n    --is-pairwise-dataset")
    with pytest.raises(ConfigError) as err:
        import_launch_script(str(path))
    text = str(err.value)
    assert "--ref-model: not supported yet: a reference model other than the policy's source" in text
    assert (
        "--is-pairwise-dataset: not supported yet: --is-pairwise-dataset (MindSpeed-LLM's preprocessed pairwise"
        in text
    )
    sft = tmp_path / "sft.sh"
    sft.write_text(
        path.read_text().replace("--stage dpo", "--stage sft").replace("--is-pairwise-dataset", "")
    )
    with pytest.raises(ConfigError) as err:
        import_launch_script(str(sft))
    assert "--stage: not supported yet: --stage sft" in str(err.value)
    assert "--dpo-beta: read only with --stage dpo" in str(err.value)
