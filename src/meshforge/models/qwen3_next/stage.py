"""Qwen3-Next's pipeline stage preparation: the attention mask; Gated DeltaNet layers get ``segment_ids``."""

from __future__ import annotations

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.stage import LayerRunner, StageBatch


def qwen3_next_stage(b: StageBatch) -> LayerRunner:
    """``Qwen3NextModel.forward``'s preparation: the attention mask; DeltaNet layers get ``segment_ids``."""
    inner, segment_ids, position_ids = b.inner, b.segment_ids, b.position_ids
    cp = getattr(inner, "cp", None)
    mask = None
    if cp is not None:
        # Context parallel (ulysses; Qwen3NextModel.cp): one CPMask for the attention layers and
        # the global positions; the DeltaNet layers gather the full row's document ids themselves.
        mask, position_ids = cp.prepare(b.ids, position_ids, segment_ids)
    elif segment_ids is not None:
        # Each stage restarts nothing itself: a DeltaNet layer resets its state and conv window
        # at every document start it sees in segment_ids, whichever stage it runs on.
        if any(layer.layer_type != "linear_attention" for layer in b.layers):
            mask = segment_causal_mask(segment_ids)
        if position_ids is None:
            position_ids = positions_from_segments(segment_ids)
    rope = inner.rotary_emb(position_ids, seq_len=b.seq_len, device=b.h.device, dtype=b.h.dtype)
    return lambda layer, x: layer(x, rope, mask, segment_ids)
