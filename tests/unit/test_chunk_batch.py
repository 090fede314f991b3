"""Chunked micro-batches (parallelism.enable_chunk_batch): the same numbers as one call per layer."""

from __future__ import annotations

import copy

import pytest
import torch

from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
from meshforge.models.qwen3_moe.model import build_qwen3_moe
from meshforge.parallel.chunk_batch import apply_chunk_batch
from meshforge.parallel.config import MS_CHUNK_KWARGS
from tests._compare import assert_close

ARGS = Qwen3MoeArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)


def _loss_and_grads(model, ids, segments):
    logits = model(ids, segment_ids=segments)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    total = loss + 0.02 * model.aux_loss()
    total.backward()
    counts = [
        m.last_tokens_per_expert.clone() for m in model.modules() if hasattr(m, "last_tokens_per_expert")
    ]
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_layers_give_the_same_loss_aux_loss_and_gradients(chunks: int) -> None:
    torch.manual_seed(0)
    model = build_qwen3_moe(ARGS, device="cpu")
    chunked = copy.deepcopy(model)
    wrapped = apply_chunk_batch(
        chunked, chunks=chunks, modules=["model.layers.{*}"], kwarg_names=MS_CHUNK_KWARGS
    )
    assert wrapped == 2
    ids = torch.randint(0, 64, (5, 12))
    # Packed rows: per-row masks (batch 5) must be split with the hidden states.
    segments = torch.tensor([[1] * 6 + [2] * 6, [1] * 12, [1] * 4 + [2] * 8, [1] * 10 + [0] * 2, [1] * 12])
    want_loss, want_grads, want_counts = _loss_and_grads(model, ids, segments)
    got_loss, got_grads, got_counts = _loss_and_grads(chunked, ids, segments)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-7)
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, what=name)
    for got, want in zip(got_counts, want_counts, strict=True):
        assert torch.equal(got, want)


def test_a_pattern_matching_nothing_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"parallelism.chunk_mbs_modules"):
        apply_chunk_batch(build_qwen3_moe(ARGS), chunks=2, modules=["model.blocks.{*}"])
