"""Full recompute of a Qwen3-Next model on real CPU tensors: backward releases each layer.

The MoE blocks record their router statistics on themselves in every forward, and the probability
sum carries autograd history. A checkpoint's recomputation runs the block's forward again in
backward; had it rebound the record, the recomputed layer's graph (every tensor it saved, the Gated
DeltaNet's conv output, q/k/v copies and delta-rule products among them) would stay alive through
the rest of backward, layer after layer, until the next forward.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from meshforge.memory.config import RecomputeConfig
from meshforge.memory.recompute import apply_recompute
from meshforge.models.qwen3_next.args import FLAVORS
from meshforge.models.qwen3_next.model import build_qwen3_next
from meshforge.train.dry_run_record import new_step_peak, peak_total

BATCH, SEQ, LAYERS = 2, 256, 4


def test_full_recompute_backward_keeps_no_recomputed_layer_alive() -> None:
    args = replace(
        FLAVORS["tiny"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,  # layers 0-2 Gated DeltaNet, 3 gated attention; all MoE
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    model = build_qwen3_next(args, device="cpu")
    apply_recompute(
        model, RecomputeConfig(mode="full", full_recompute_layer=[f"0-{LAYERS - 1}"]), num_layers=LAYERS
    )
    ids = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    memory = new_step_peak()
    memory.track_external(model)
    with memory:
        weights = peak_total(memory.get_tracker_snapshot("current"))
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        aux = model.aux_loss()
        assert aux is not None
        recorded = [block.last_aux_stats for block in model.moe_layers().values()]
        (loss + args.router_aux_loss_coef * aux).backward()
        del logits, loss, aux
        held = peak_total(memory.get_tracker_snapshot("current")) - weights
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    hidden_state = BATCH * SEQ * args.hidden_size * 4
    # The forward's records stay (the recomputation rebound none of them), and what backward
    # leaves beyond the gradients is less than one layer's input (the GDN layers' recomputed
    # intermediates are many of those each).
    after = [block.last_aux_stats for block in model.moe_layers().values()]
    assert all(a is b for a, b in zip(recorded, after, strict=True))
    assert held - gradients < hidden_state, (held - gradients, hidden_state)
