"""The DeepSeek-V3 decoder layer: multi-head latent attention, then a dense or sparse MLP.

Shared by the decoder (``model.py``) and the multi-token-prediction blocks (``mtp.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.models.common.mla import MultiHeadLatentAttention
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.sigmoid_moe import SharedExpertMoEBlock
from meshforge.models.deepseek_v3.args import DeepseekV3Args


class DeepseekV3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the MLP dense or sparse.

    Args:
        args: Structural hyper-parameters.
        layer_idx: 0-based index, which decides dense versus sparse.
    """

    def __init__(self, args: DeepseekV3Args, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(
            args.hidden_size,
            args.num_attention_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            bias=args.attention_bias,
            rope_interleave=args.rope_interleave,
            dropout=float(args.attention_dropout),
            softmax_scale=args.softmax_scale,
        )
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp: SharedExpertMoEBlock | GatedMLP
        if self.is_moe:
            self.mlp = SharedExpertMoEBlock(
                args.hidden_size,
                args.n_routed_experts,
                args.num_experts_per_tok,
                args.moe_intermediate_size,
                num_shared_experts=args.n_shared_experts,
                num_groups=args.n_group,
                topk_groups=args.topk_group,
                norm_topk_prob=args.norm_topk_prob,
                routed_scaling_factor=args.routed_scaling_factor,
                hidden_act=args.hidden_act,
            )
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


__all__ = ["DeepseekV3DecoderLayer"]
