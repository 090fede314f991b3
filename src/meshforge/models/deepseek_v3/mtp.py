"""DeepSeek-V3 multi-token prediction (MTP): ``num_nextn_predict_layers`` extra blocks that each
predict one token further ahead, sharing the model's embedding and output head.

Depth ``k`` (1-based) at position ``i`` combines the previous depth's hidden state (the main
model's normed output for ``k = 1``) with the embedding of token ``i + k``, and its logits are
scored against token ``i + k + 1``, i.e. ``labels[i + k]``::

    x   = eh_proj(cat(enorm(embed(input_ids[i + k])), hnorm(h_{k-1}[i])))
    h_k = shared_head.norm(decoder_layer(x))          # same RoPE and mask as the main layers
    logits_k = lm_head(h_k)                           # targets: meshforge.loss.cross_entropy.mtp_labels

This is DeepSeek-V3's MTP module (report section 2.2) with the layout of Megatron's
``MultiTokenPredictionLayer`` that MindSpeed trains: the hidden state handed to each depth is
the normed one, the block is a full decoder layer (MLA and the MoE block), and the depth's
output norm is ``shared_head.norm``. Each MTP block sits in ``model.layers`` after the decoder
layers, at ``model.layers.{num_hidden_layers + k - 1}``, so its parameter names are the
published checkpoint's (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``self_attn``,
``mlp``, the two layer norms) and tensor, expert and fully-sharded data parallelism treat it as
one more layer. Published files also carry per-block copies of the embedding and head
(``embed_tokens``, ``shared_head.head``); here both are the model's own, shared.
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.models.common.norms import RMSNorm
from meshforge.models.deepseek_v3.args import DeepseekV3Args
from meshforge.models.deepseek_v3.layer import DeepseekV3DecoderLayer


class SharedHead(nn.Module):
    """The depth's output norm; the head itself is the model's ``lm_head`` (``shared_head.head``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One MTP depth: the input projection, a decoder layer, the output norm.

    Args:
        args: Structural hyper-parameters.
        layer_idx: Its index in ``model.layers`` (``num_hidden_layers`` + depth - 1), which
            decides dense versus sparse as for any layer.
    """

    def __init__(self, args: DeepseekV3Args, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.shared_head = SharedHead(args.hidden_size, args.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """This depth's normed hidden states from the shifted embeddings and the previous depth.

        Everything happens inside one ``forward`` so that the block's wrappers (FSDP unit,
        activation checkpointing) cover the projection and the norms too.
        """
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, rope, mask))


def shift_left(ids: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``ids`` moved ``k`` places to the left along the last dim, the last ``k`` set to ``fill``."""
    if k == 0:
        return ids
    tail = ids.new_full((*ids.shape[:-1], min(k, ids.shape[-1])), fill)
    return torch.cat([ids[..., k:], tail], dim=-1)


__all__ = ["DeepseekV3MTPLayer", "SharedHead", "shift_left"]
