"""gpt-oss' pipeline stage preparation: full and sliding-window masks (the stage's layers decide), RoPE."""

from __future__ import annotations

from typing import cast

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.stage import LayerRunner, StageBatch


def gpt_oss_stage(b: StageBatch) -> LayerRunner:
    """``GptOssModel.forward``'s preparation: full and sliding masks, token mask, RoPE."""
    inner, segment_ids, position_ids = b.inner, b.segment_ids, b.position_ids
    from meshforge.models.common.sink_attention import causal_mask, sliding_window_mask

    token_mask = None
    masks: dict[str, object]
    cp = getattr(inner, "cp", None)
    if cp is not None:
        # Context parallel (GptOssModel.cp): one mask object for both kinds of layer; each
        # attention applies its own window in global positions.
        cp_mask, position_ids = cp.prepare(b.ids, position_ids, segment_ids)
        if segment_ids is not None:
            token_mask = segment_ids != 0
        rope = inner.rotary_emb(position_ids, seq_len=b.h.shape[1], device=b.h.device, dtype=b.h.dtype)
        return lambda layer, x: layer(x, rope, cp_mask, token_mask)
    if segment_ids is not None:
        full = segment_causal_mask(segment_ids)
        token_mask = segment_ids != 0
        if position_ids is None:
            position_ids = positions_from_segments(segment_ids)
    else:
        full = causal_mask(b.seq_len, b.h.device)
    masks = {"full_attention": full}
    # Only the stage's own layers decide whether the sliding mask is needed.
    if any(layer.attention_type == "sliding_attention" for layer in b.layers):
        masks["sliding_attention"] = sliding_window_mask(full, inner.sliding_window)
    rope = inner.rotary_emb(position_ids, seq_len=b.seq_len, device=b.h.device, dtype=b.h.dtype)
    # Each layer is a GptOssDecoderLayer, whose attention_type names its mask.
    return lambda layer, x: layer(x, rope, masks[cast(str, layer.attention_type)], token_mask)
