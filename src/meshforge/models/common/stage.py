"""What a pipeline stage runs before its decoder layers: the shared ``StageBatch`` and the
preparation of the ``DecoderModel`` families.

Each family's inner model builds masks and RoPE tables once before its layers; a pipeline stage
does the same for its own layers from the micro-batch's ``position_ids``/``segment_ids`` (tiny
next to one layer's compute). A family's spec names its preparation
(``FamilySpec.stage_preparation``): ``prepare(StageBatch) -> run(layer, h) -> h``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask

LayerRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StageBatch:
    """What a stage's preparation (``FamilySpec.stage_preparation``) gets for one micro-batch.

    Attributes:
        inner: The family's inner model (``model.model``), pruned to this rank's stages.
        ids: Token ids ``[B, S]``, or a ``[B, S]`` view of the hidden states after the first
            stage (shape and device are what the CP plans read).
        h: The hidden states entering the stage's first layer.
        position_ids, segment_ids: The micro-batch's, as ``CausalLM.forward`` takes them.
        seq_len: Tokens per row (under sequence parallelism ``h`` holds only a slice).
        layers: The stage's decoder layers, in order.
        model: The pruned causal LM the stage belongs to, for a preparation that reads state the
            model keeps outside ``inner`` (the CP plan a transformers wrapper holds); None when a
            stage runs alone.
    """

    inner: Any
    ids: torch.Tensor
    h: torch.Tensor
    position_ids: torch.Tensor | None
    segment_ids: torch.Tensor | None
    seq_len: int
    layers: list[nn.Module]
    model: Any = None


def decoder_stage(b: StageBatch) -> LayerRunner:
    """``DecoderModel.forward``'s preparation: one mask (or CP mask object) for every layer."""
    inner, segment_ids, position_ids = b.inner, b.segment_ids, b.position_ids
    mask = token_mask = None
    cp = getattr(inner, "cp", None)
    if cp is not None:
        # Context parallel (DecoderModel.cp): the plan reads only the shape and device of
        # the token ids, which a [B, S] view of the hidden states has too.
        mask, position_ids = cp.prepare(b.ids, position_ids, segment_ids)
        if inner.pass_token_mask and segment_ids is not None:
            token_mask = segment_ids != 0
    elif segment_ids is not None:
        mask = segment_causal_mask(segment_ids)
        if inner.pass_token_mask:
            token_mask = segment_ids != 0
        if position_ids is None:
            position_ids = positions_from_segments(segment_ids)
    rope = inner.rotary_emb(position_ids, seq_len=b.seq_len, device=b.h.device, dtype=b.h.dtype)
    if inner.pass_token_mask:
        return lambda layer, x: layer(x, rope, mask, token_mask)
    return lambda layer, x: layer(x, rope, mask)


__all__ = ["LayerRunner", "StageBatch", "decoder_stage"]
