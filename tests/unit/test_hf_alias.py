"""A tied head copy (a pipeline's last stage) loads the embedding's stored weights through the adapter."""

from __future__ import annotations

from dataclasses import replace

import torch

from meshforge.checkpoint.hf import load_hf_weights, save_hf
from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
from meshforge.models.qwen3_moe.model import build_qwen3_moe
from meshforge.models.qwen3_moe.spec import FAMILY

TIED = Qwen3MoeArgs(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=True,
)


def test_head_copy_of_a_tied_moe_checkpoint_loads_from_the_embedding(tmp_path) -> None:
    # qwen3_moe's adapter converts by parameter name (fused experts), so the copy must be
    # converted under its source's name: this failed with "expected exactly the key lm_head.weight".
    torch.manual_seed(0)
    saved = build_qwen3_moe(TIED, device="cpu")
    save_hf(saved, FAMILY, tmp_path / "hf")
    copy = build_qwen3_moe(replace(TIED, tie_word_embeddings=False), device="cpu")
    load_hf_weights(
        copy, FAMILY, tmp_path / "hf", partial=True, aliases={"lm_head.weight": "model.embed_tokens.weight"}
    )
    torch.testing.assert_close(copy.lm_head.weight, saved.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(
        copy.model.embed_tokens.weight, saved.model.embed_tokens.weight, rtol=0, atol=0
    )
