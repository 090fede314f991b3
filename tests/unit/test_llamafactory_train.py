"""LLaMA-Factory's LoRA SFT example trains unchanged but for the model path and the step count, on
LLaMA-Factory's own data/ folder (identity + alpaca_en_demo, copied in tests/data/llamafactory), and
leaves what LLaMA-Factory leaves in output_dir: a PEFT adapter that peft loads, trainer_log.jsonl
and training_loss.png.

One more edit: `preprocessing_num_workers: 16` is dropped, since 16 encoding processes on a
2-core test machine cost more than the encoding (it changes no row: test_sft_llamafactory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, train_here
from tests.unit.test_hf_interop import _save_hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

LF = Path(__file__).resolve().parents[1] / "data" / "llamafactory"
EXAMPLE = LF / "examples" / "train_lora" / "qwen3_lora_sft.yaml"
STEPS = 3


def _edited_example(model: Path) -> str:
    text = EXAMPLE.read_text(encoding="utf-8")
    edits = {
        "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507": f"model_name_or_path: {model}",
        "num_train_epochs: 3.0": f"max_steps: {STEPS}",
        "preprocessing_num_workers: 16\n": "",
    }
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_lora_sft_example_leaves_a_peft_adapter_and_the_loss_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Positions for the example's cutoff_len: 2048.
    hf = _save_hf_model(
        tmp_path / "Qwen3-tiny", tied=False, shard=None, seed=3, options={"max_position_embeddings": 2048}
    )
    shutil.copytree(LF / "data", tmp_path / "data")  # LLaMA-Factory's dataset_dir default is ./data
    config = tmp_path / "qwen3_lora_sft.yaml"
    config.write_text(_edited_example(hf), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    train_here(config, [], log=lines.append)

    out = tmp_path / "saves" / "qwen3-4b" / "lora" / "sft"
    assert "import: detected format: LLaMA-Factory" not in lines  # train logs the import itself:
    assert any(line.endswith("LLaMA-Factory format; importing") for line in lines)
    assert len(read_metrics(out)) == STEPS

    # trainer_log.jsonl: LLaMA-Factory's record, on its logging steps (10 > 3: only the last one).
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in records] == [STEPS]
    assert {
        "current_steps",
        "total_steps",
        "loss",
        "lr",
        "epoch",
        "percentage",
        "elapsed_time",
        "remaining_time",
    } <= set(records[0])
    assert records[0]["total_steps"] == STEPS and records[0]["percentage"] == 100.0

    png = out / "training_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The adapter in output_dir itself, as LLaMA-Factory leaves it; peft loads it onto the base.
    config_body = json.loads((out / "adapter_config.json").read_text())
    assert config_body["r"] == 8 and config_body["lora_alpha"] == 16
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 7, 1000, 12, 3]])
    with torch.no_grad():
        before = base(ids).logits
    model = peft.PeftModel.from_pretrained(base, out).eval()
    saved = safetensors_torch.load_file(out / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) == 2 * 7 * 2  # A and B of the 7 linears of 2 layers (lora_target: all)
    for key, tensor in saved.items():
        assert torch.equal(loaded[key.replace(".weight", ".default.weight")], tensor), key
    with torch.no_grad():
        after = model(ids).logits
    assert not torch.equal(before, after)  # trained B matrices change the output


FULL = LF / "examples" / "train_full" / "qwen3_full_sft.yaml"
PRETRAIN = LF / "examples" / "train_lora" / "qwen3_lora_pretrain.yaml"


@pytest.mark.parametrize("example", [FULL, PRETRAIN], ids=["full_sft_ds_z3", "lora_pretrain"])
def test_full_and_pretraining_examples_train(
    example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full SFT example (its DeepSpeed ZeRO-3 JSON read) leaves HF weights in output_dir; the
    LoRA pretraining example packs c4_demo's text (stage pt) and leaves its adapter. Edited: model
    path, step count, no preprocessing workers, and the pretraining rows shortened."""
    hf = _save_hf_model(
        tmp_path / "Qwen3-tiny", tied=False, shard=None, seed=3, options={"max_position_embeddings": 2048}
    )
    shutil.copytree(LF / "data", tmp_path / "data")
    shutil.copytree(LF / "examples" / "deepspeed", tmp_path / "examples" / "deepspeed")
    text = example.read_text(encoding="utf-8")
    for old, new in {
        "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507": f"model_name_or_path: {hf}",
        "num_train_epochs: 3.0": "max_steps: 2",
        "preprocessing_num_workers: 16\n": "",
        # pt packs full rows: 2 steps x 8 micro-batches x 2048 tokens cost 10 s in bf16 on 2 cores.
        "cutoff_len: 2048": "cutoff_len: 256" if example is PRETRAIN else "cutoff_len: 2048",
    }.items():
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / example.name
    config.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    train_here(config, [], log=lines.append)
    out = tmp_path / yaml_output_dir(text)
    assert len(read_metrics(out)) == 2
    assert (out / "trainer_log.jsonl").is_file() and (out / "training_loss.png").is_file()
    if example is FULL:
        assert any(line.startswith("deepspeed: ZeRO-3 -> FSDP2 full sharding") for line in lines)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        changed = [n for n, p in reloaded.named_parameters() if not torch.equal(p, base.get_parameter(n))]
        assert changed  # the trained weights, as LLaMA-Factory leaves them in output_dir
    else:
        assert any("train_dataset.dataloader.type = 'TextDataLoader'" in line for line in lines)
        assert (out / "adapter_model.safetensors").is_file()


def yaml_output_dir(text: str) -> str:
    return next(
        line.split(":", 1)[1].split("#")[0].strip()
        for line in text.splitlines()
        if line.startswith("output_dir:")
    )
