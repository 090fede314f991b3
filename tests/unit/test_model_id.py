"""MindSpeed's `model_id` selects a built-in family; unknown ids point to the generic path."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.models.registry import resolve_family
from tests.conftest import TINY_CONFIG, read_metrics, train_cli, write_corpus


@pytest.mark.slow  # whole trainings
def test_model_id_trains_the_built_in_family(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=50)
    config = tmp_path / "by_id.yaml"
    config.write_text(TINY_CONFIG.format(data=corpus).replace("model_type: qwen3", "model_id: qwen3"))
    out = tmp_path / "run"
    proc = train_cli(config, ["--training.steps=2", f"--training.output_dir={out}"], cwd=tmp_path)
    assert "model: qwen3 with" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.parametrize("model_id", ["longcat_flash_ngram", "glm52", "deepseek_v4"])
def test_unbuilt_model_id_names_the_generic_path(model_id: str) -> None:
    with pytest.raises(ValueError, match="generic transformers path, set model.model_name_or_path"):
        resolve_family(model_id=model_id)
