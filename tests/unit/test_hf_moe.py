"""Qwen3-MoE through the HF folder path: per-expert safetensors keys <-> fused in-memory experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from meshforge.checkpoint.hf import load_hf_weights, save_hf
from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict

OPTIONS = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}


@pytest.mark.parametrize("tied", [True, False])
def test_moe_hf_folder_loads_and_exports_with_transformers_logits(tied: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**OPTIONS, tie_word_embeddings=tied)
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src, max_shard_size="100KB")

    model_cfg = config_from_dict({"model": {"model_name_or_path": str(src)}}).model
    source = resolve_model_source(model_cfg)
    assert source.family.name == "qwen3_moe"
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    load_hf_weights(model, source.family, src)
    model.eval()

    ids = torch.randint(0, OPTIONS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        ours = model(ids)
        assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()

        out = tmp_path / "export"
        save_hf(model, source.family, out)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (reloaded(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
