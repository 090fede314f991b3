"""Chunked micro-batches under context parallelism (2 processes, gloo) equal the unchunked run and one process.

The decoder layers run on row slices of the micro-batch (``apply_chunk_batch``) while the CP
attention reads the per-forward :class:`~meshforge.parallel.context.CPMask`, which holds the full
rows' document ids: each chunk must get the mask of its own rows (``CPMask.narrow_batch``). The
rows pack different documents, so a chunk attending with another row's documents gives other
numbers. Checked for qwen3 and qwen3_moe (router aux loss included, its statistics summed over the
chunks and reduced over the CP ranks) with ulysses and colossal: logits, loss and every gradient
(summed over the CP ranks) against the unchunked CP run and against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._compare import rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

SEQ, ROWS, VOCAB = 16, 4, 64
AUX_COEF = 0.02
TOL = 1e-5


def _args(moe: bool):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    if moe:
        from meshforge.models.qwen3_moe.args import Qwen3MoeArgs

        return Qwen3MoeArgs(
            **common,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=AUX_COEF,
        )
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(**common)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    # Every row packs its documents differently (cut across the CP chunks); row 3 ends in padding.
    seg = torch.tensor(
        [
            [1] * 5 + [2] * 7 + [3] * 4,
            [1] * SEQ,
            [1] * 2 + [2] * 12 + [3] * 2,
            [1] * 9 + [2] * 5 + [0] * 2,
        ]
    )
    return {"input_ids": input_ids, "labels": labels.masked_fill(seg == 0, -100), "segment_ids": seg}


def _build(moe: bool):
    from meshforge.models.qwen3.model import build_qwen3
    from meshforge.models.qwen3_moe.model import build_qwen3_moe

    return (build_qwen3_moe if moe else build_qwen3)(_args(moe), device="cpu")


def _reference(moe: bool, batch, tokens):
    """One process, no CP, no chunks: logits, total loss, gradients."""
    from meshforge.loss.cross_entropy import cross_entropy_sum

    model = _build(moe)
    logits = model(batch["input_ids"], None, batch["segment_ids"])
    loss = cross_entropy_sum(logits, batch["labels"]) / tokens
    if moe:
        loss = loss + AUX_COEF * model.aux_loss()
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_run(moe: bool, method: str, mesh, batch, tokens, chunks: int | None):
    """This rank's CP run (chunked when ``chunks``): full logits, total loss, CP-summed gradients."""
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.models.common.moe import set_aux_reduce_group
    from meshforge.parallel.chunk_batch import apply_chunk_batch
    from meshforge.parallel.config import MS_CHUNK_KWARGS
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp, unshard_sequence

    model = _build(moe)
    apply_cp(model, mesh, method=method)
    if moe:
        set_aux_reduce_group(model, mesh)
    if chunks is not None:
        # As parallelize_model: chunking goes on after CP.
        wrapped = apply_chunk_batch(
            model, chunks=chunks, modules=["model.layers.{*}"], kwarg_names=MS_CHUNK_KWARGS
        )
        assert wrapped == 2
    local = shard_batch_for_cp(batch, mesh, method=method)
    logits = model(local["input_ids"], local["position_ids"], local["segment_ids"])
    loss = cross_entropy_sum(logits, local["labels"]) / tokens
    if moe:
        # As Trainer.forward_backward: the (CP-reduced, whole-row) aux loss weighted by this
        # rank's share of the valid tokens; the shares add up to one over the CP ranks.
        loss = loss + AUX_COEF * model.aux_loss() * count_valid_tokens(local["labels"]) / tokens
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        grads[name] = grad
    counts = [
        m.last_tokens_per_expert.clone() for m in model.modules() if hasattr(m, "last_tokens_per_expert")
    ]
    return unshard_sequence(logits.detach(), mesh, method=method), total, grads, counts


def _check(moe: bool, method: str, chunks: int, mesh) -> None:
    batch = _batch()
    tokens = (batch["labels"] != -100).sum()
    what = f"{'qwen3_moe' if moe else 'qwen3'} cp2 {method} chunk_mbs {chunks}"
    ref_logits, ref_loss, ref_grads = _reference(moe, batch, tokens)
    plain = _cp_run(moe, method, mesh, batch, tokens, None)
    chunked = _cp_run(moe, method, mesh, batch, tokens, chunks)
    for label, (logits, loss, grads, _) in (("unchunked", plain), ("chunked", chunked)):
        assert rel_error(logits, ref_logits) <= TOL, (what, label, "logits", rel_error(logits, ref_logits))
        assert rel_error(loss, ref_loss) <= TOL, (what, label, "loss", loss, ref_loss)
        for name, want in ref_grads.items():
            assert rel_error(grads[name], want) <= TOL, (what, label, name, rel_error(grads[name], want))
    # Chunked against unchunked CP: the same operations on fewer rows, so (nearly) bit-equal.
    assert rel_error(chunked[0], plain[0]) <= 1e-6, (what, "logits vs unchunked")
    for name, want in plain[2].items():
        assert rel_error(chunked[2][name], want) <= TOL, (what, "grad vs unchunked", name)
    for got, want in zip(chunked[3], plain[3], strict=True):
        assert torch.equal(got, want), (what, "tokens per expert", got, want)


def _check_mask_slices(mesh) -> None:
    from meshforge.parallel.context import CPMask

    batch = _batch()
    seg = batch["segment_ids"]
    mask = CPMask(q_index=torch.arange(SEQ // 2), seq_len=SEQ, segments=seg)
    part = mask.narrow_batch(0, 1, 3)
    assert torch.equal(part.segments, seg[1:3]) and part.cache is not mask.cache and part.seq_len == SEQ
    # Every layer of a forward gets the same slice object (and so shares its derived masks).
    assert mask.narrow_batch(0, 1, 3) is part
    assert mask.narrow_batch(0, 0, ROWS) is mask
    plain = CPMask(q_index=torch.arange(SEQ // 2), seq_len=SEQ, segments=None)
    assert plain.narrow_batch(0, 0, 1) is plain
    with pytest.raises(ValueError, match=r"parallelism.chunk_mbs_batch_dim: 1"):
        mask.narrow_batch(1, 0, 2)
    with pytest.raises(ValueError, match=r"rows 2:6 of a 4-row batch"):
        mask.narrow_rows(2, 6)


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    _check_mask_slices(mesh)
    for moe in (False, True):
        for method in ("ulysses", "colossal"):
            _check(moe, method, 2, mesh)
    # Uneven chunks (rows 2, 1, 1) on the ring's fused kernel path.
    _check(False, "colossal", 3, mesh)


def test_chunked_micro_batches_under_cp2_equal_unchunked_and_one_process() -> None:
    run_workers(_worker, 2)
