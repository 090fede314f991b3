"""Pipeline parallelism for gpt_oss and qwen3_next on 2 processes (gloo) equals one process.

One launch runs every layout against a single-process reference with the same weights and data
(two optimizer steps, CE sums and every gradient within 1e-5 relative): gpt_oss with sliding and
full layers on different stages (a stage builds the sliding mask only when it runs a sliding
layer) and attention sinks; qwen3_next with Gated DeltaNet and gated-attention layers on both
ranks and a dense layer, where packed documents must restart the DeltaNet state on whichever
stage runs it. Each family runs 1f1b with an uneven split and interleaved (2 stages per rank)
with an uneven split, tied and untied embeddings. The router aux loss is off here
(``tests/distributed/test_aux_parallel.py`` covers it under pipelining).
"""

from __future__ import annotations

import pytest
import torch

from tests._compare import assert_close
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

WORLD = 2
VOCAB, SEQ, MB, N_MICRO = 64, 8, 2, 4
RTOL = 1e-5

# (name, family, schedule, interleave, layers_per_stage, tied)
CASES = [
    ("gpt_oss 1f1b uneven tied", "gpt_oss", "1f1b", 1, ["0", "1-4"], True),
    ("gpt_oss interleaved uneven untied", "gpt_oss", "interleaved", 2, ["0,3", "1-2,4"], False),
    ("qwen3_next 1f1b uneven untied", "qwen3_next", "1f1b", 1, ["0-2", "3-4"], False),
    ("qwen3_next interleaved uneven tied", "qwen3_next", "interleaved", 2, ["0,2-3", "1,4"], True),
]


def family_args(family: str, tied: bool, *, aux: bool = False):
    """Tiny 5-layer arguments (shared with test_aux_parallel)."""
    if family == "gpt_oss":
        from meshforge.models.gpt_oss.args import GptOssArgs

        # Layers: sliding, full, sliding, full, sliding (the default alternation).
        return GptOssArgs(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            output_router_logits=aux,
        )
    from meshforge.models.qwen3_next.args import Qwen3NextArgs

    # Layers: DeltaNet, attention, DeltaNet, attention, DeltaNet; layer 0 dense, the rest MoE.
    return Qwen3NextArgs(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        max_position_embeddings=64,
        num_hidden_layers=5,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        tie_word_embeddings=tied,
        output_router_logits=aux,
    )


def build_family(family: str, tied: bool, *, aux: bool = False):
    """The full model on cpu with the builder's fixed per-parameter seeds."""
    if family == "gpt_oss":
        from meshforge.models.gpt_oss.model import build_gpt_oss

        return build_gpt_oss(family_args(family, tied, aux=aux), device="cpu")
    from meshforge.models.qwen3_next.model import build_qwen3_next

    return build_qwen3_next(family_args(family, tied, aux=aux), device="cpu")


def micro_batches() -> list[dict[str, torch.Tensor]]:
    """Packed rows (two documents) and padded rows; some labels ignored."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N_MICRO):
        ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels[:, : i % 3] = -100
        seg = torch.tensor([[1] * 3 + [2] * (SEQ - 3), [1] * (SEQ - 2) + [0] * 2])
        out.append({"input_ids": ids, "labels": labels, "segment_ids": seg})
    return out


def _reference(family: str, tied: bool, micro, steps: int = 2):
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    model = build_family(family, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        for mb in micro:
            ce = cross_entropy_sum(model(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            (ce / tokens).backward()
            total += ce.detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        history.append((total, grads))
        opt.step()
    return history, tokens


# After one AdamW step the weights differ by float32 rounding, and a few gradients are tiny
# (qwen3_next's dt_bias: ~1e-5); their second-step error (~2e-10) is rounding, not a wrong term.
GRAD_FLOOR = 1e-4


def _run_case(rank: int, case, pp_mesh) -> None:
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name, family, schedule, interleave, spec, tied = case
    micro = micro_batches()
    history, tokens = _reference(family, tied, micro)
    model = build_family(family, tied)
    split = split_model(
        model, pp_rank=rank, pp_size=WORLD, layers_per_stage=spec, interleave=interleave, schedule=schedule
    )
    if split.tied_across_ranks and split.has_last:
        with torch.no_grad():  # build_pipeline must copy the embedding into the head copy
            split.model.lm_head.weight.zero_()
    opt = torch.optim.AdamW(split.model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = build_pipeline(
        split, split.model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule=schedule
    )
    for step, (want_ce, want_grads) in enumerate(history):
        opt.zero_grad()
        ce = pipe.step(micro, tokens)
        assert_close(ce, want_ce, floor=1e-6, what=f"[{name}] step {step} CE sum on rank {rank}")
        for n, p in split.model.named_parameters():
            assert p.grad is not None, f"[{name}] {n} has no grad"
            assert_close(
                p.grad,
                want_grads[n],
                floor=GRAD_FLOOR if step else 1e-6,
                what=f"[{name}] step {step} grad {n}",
            )
        opt.step()


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("pp",))
    for case in CASES:
        torch.manual_seed(0)
        _run_case(rank, case, mesh["pp"])


def test_pp2_gpt_oss_and_qwen3_next_equal_one_process() -> None:
    run_workers(_worker, WORLD)
