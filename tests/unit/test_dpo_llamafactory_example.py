"""LLaMA-Factory's DPO LoRA example trains unchanged but for the model path and the step count, on
LLaMA-Factory's own `dpo_en_demo` data (its first 24 records, copied in tests/data/llamafactory).

Policy and reference start equal (LoRA's B is zero, the reference is the adapters-off base), so the
first loss is ln 2 and every reward is 0; the reward metrics are logged. As in test_llamafactory_train.py,
`preprocessing_num_workers: 16` is dropped (16 encoding processes on a 2-core test machine).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_metrics, train_here
from tests.unit.test_hf_interop import _save_hf_model

pytest.importorskip("transformers")

LF = Path(__file__).resolve().parents[1] / "data" / "llamafactory"
EXAMPLE = LF / "examples" / "train_lora" / "qwen3_lora_dpo.yaml"
# Two steps of 8 pairs (each sequence up to the example's cutoff_len, 2048 tokens).
STEPS = 2


def test_llamafactory_dpo_lora_example_trains_from_ln2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = _save_hf_model(
        tmp_path / "Qwen3-tiny", tied=False, shard=None, seed=3, options={"max_position_embeddings": 2048}
    )
    shutil.copytree(LF / "data", tmp_path / "data")  # LLaMA-Factory's dataset_dir default is ./data
    text = EXAMPLE.read_text(encoding="utf-8")
    edits = {
        "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507": f"model_name_or_path: {hf}",
        "num_train_epochs: 3.0": f"max_steps: {STEPS}",
        "preprocessing_num_workers: 16\n": "",
    }
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "qwen3_lora_dpo.yaml"
    config.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    train_here(config, [], log=lines.append)

    assert any(
        "preference: sigmoid loss, beta 0.1; reference model: the policy with LoRA" in s for s in lines
    )
    assert any("24 pair train rows" in s for s in lines), lines
    records = read_metrics(tmp_path / "saves" / "qwen3-4b" / "lora" / "dpo")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    first = records[0]
    assert first["pairs"] == 8  # per_device_train_batch_size 1 x gradient_accumulation_steps 8
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert records[1]["pairs"] == 8 and records[1]["rewards/margins"] != 0.0  # the adapters moved
