"""The built-in Qwen3-MoE causal LM: transformers' module tree, meshforge's forward.

In-memory parameter names are exactly those of ``transformers.Qwen3MoeForCausalLM``
5.24: attention as in Qwen3, and on sparse layers ``mlp.gate.weight`` (router) plus
the fused 3-D ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``; dense layers
(``mlp_only_layers``, or ``(i + 1) % decoder_sparse_step != 0``) carry a plain
``mlp.{gate,up,down}_proj``. Safetensors use per-expert keys; ``hf.py`` maps them.

Besides logits, a forward leaves two things for the trainer and the monitor:
``aux_loss()`` (the Switch load-balancing loss over all MoE layers, unscaled, as
transformers computes it; padding tokens, ``segment_ids == 0``, are excluded the way
transformers excludes them through its attention mask) and ``tokens_per_expert()``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.causal_lm import DecoderModel, MoECausalLM, build_causal_lm
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.moe import MoEBlock
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.qwen3_moe.args import Qwen3MoeArgs


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, the MLP dense or sparse.

    Args:
        args: Structural hyper-parameters.
        layer_idx: 0-based index, which decides dense versus sparse.
    """

    def __init__(self, args: Qwen3MoeArgs, layer_idx: int) -> None:
        super().__init__()
        assert args.num_key_value_heads is not None  # Qwen3MoeArgs.__post_init__ fills it
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.attn_head_dim,
            bias=args.attention_bias,
            qk_norm=True,
            norm_eps=args.rms_norm_eps,
            dropout=float(args.attention_dropout),
        )
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp: MoEBlock | GatedMLP
        if self.is_moe:
            self.mlp = MoEBlock(
                args.hidden_size,
                args.num_experts,
                args.num_experts_per_tok,
                args.moe_intermediate_size,
                norm_topk_prob=args.norm_topk_prob,
                hidden_act=args.hidden_act,
            )
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, token_mask) if self.is_moe else self.mlp(h))


class Qwen3MoeModel(DecoderModel):
    """Embedding, decoder layers and final norm (transformers' ``Qwen3MoeModel``)."""

    # Padding (segment id 0) is left out of the routers' aux-loss statistics.
    pass_token_mask = True

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.attn_head_dim, args.theta)


class Qwen3MoeForCausalLM(MoECausalLM[Qwen3MoeArgs]):
    """Qwen3-MoE decoder with a language-model head; see the module docstring.

    Tying, forward, kernel switches, init, parameter counts, the aux loss (only when
    ``output_router_logits``, which published checkpoints ship false) and the routing
    counts come from ``MoECausalLM``.

    Args:
        args: Structural hyper-parameters (``Qwen3MoeArgs``).
    """

    family = "qwen3_moe"
    display_name = "Qwen3-MoE"
    init_normal_suffixes = ("_proj.weight", ".experts.gate_up_proj", ".experts.down_proj", ".mlp.gate.weight")

    def __init__(self, args: Qwen3MoeArgs) -> None:
        if args.use_sliding_window:
            raise ValueError("use_sliding_window: not supported yet for the built-in qwen3_moe model")
        super().__init__(args, Qwen3MoeModel(args))

    @property
    def num_routed_experts(self) -> int:
        return self.args.num_experts

    def moe_layers(self) -> dict[int, MoEBlock]:
        """The sparse blocks by decoder-layer index."""
        # A layer with is_moe holds its MoEBlock as mlp.
        return {i: cast(MoEBlock, layer.mlp) for i, layer in enumerate(self.model.layers) if layer.is_moe}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token over the active parameters: ``6 * N_active + 12 * L * H * D * S``.

        ``N_active`` counts every matmul weight a token goes through: attention, dense
        MLPs, routers, ``num_experts_per_tok`` experts per MoE layer and the LM head (a
        tied head still does its matmul), not the embedding lookup or norms. The
        second term is the attention score and value products, as for Qwen3.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul_params = self.num_params(exclude_embedding=True, active=True)
        if a.tie_word_embeddings:
            matmul_params += a.vocab_size * a.hidden_size
        matmul_params -= sum(p.numel() for n, p in self.named_parameters() if n.endswith("norm.weight"))
        attention = 12 * a.num_hidden_layers * a.num_attention_heads * a.attn_head_dim * seq_len
        return 6.0 * matmul_params + attention


def build_qwen3_moe(args: Qwen3MoeArgs, *, device: str | torch.device = "meta") -> Qwen3MoeForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator
    seeded by the parameter's position in ``named_parameters`` order.
    """
    return build_causal_lm(Qwen3MoeForCausalLM, args, device)


__all__ = ["Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "Qwen3MoeModel", "build_qwen3_moe"]
