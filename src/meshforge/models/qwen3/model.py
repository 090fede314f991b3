"""The built-in Qwen3 causal LM: transformers' module tree, meshforge's forward.

Parameter names are exactly those of ``transformers.Qwen3ForCausalLM``
(``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``, ...), so HF
state dicts load without renaming and module patterns mean the same for both. The
forward is leaner than the reference: no cache or output plumbing, causal SDPA
without a mask tensor unless documents are packed, RoPE tables cached across steps,
and the fused ``rms_norm`` kernel. It returns logits in the compute dtype; the loss
(and its float32 upcast) belongs to the trainer.
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.causal_lm import CausalLM, DecoderModel, build_causal_lm
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.qwen3.args import Qwen3Args


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        assert args.num_key_value_heads is not None  # Qwen3Args.__post_init__ fills it
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm=True,
            norm_eps=args.rms_norm_eps,
            dropout=float(args.attention_dropout),
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(DecoderModel):
    """Embedding, decoder layers and final norm (transformers' ``Qwen3Model``)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.theta)


class Qwen3ForCausalLM(CausalLM[Qwen3Args]):
    """Qwen3 decoder with a language-model head; see the module docstring.

    Tying, forward, kernel switches, init and parameter counts come from ``CausalLM``.

    Args:
        args: Structural hyper-parameters (``Qwen3Args``).
    """

    family = "qwen3"
    display_name = "Qwen3"

    def __init__(self, args: Qwen3Args) -> None:
        if args.uses_sliding_window:
            raise ValueError("use_sliding_window: not supported yet for the built-in qwen3 model")
        super().__init__(args, Qwen3Model(args))

    def _init_error(self, fqn: str) -> str:
        return f"{super()._init_error(fqn)} ({fqn.rsplit('.', 2)[-1]})"

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 * N + 12 * L * H * D * S``.

        ``N`` counts every matmul weight including the LM head (a tied head still does
        its matmul) but not the embedding lookup; the second term is the QK^T and
        attention-times-V products (forward 2 * 2 * S * H * D per token and layer,
        times 3 for forward plus backward), without halving for causality.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul_params = self.num_params(exclude_embedding=True)
        if a.tie_word_embeddings:
            matmul_params += a.vocab_size * a.hidden_size
        matmul_params -= sum(p.numel() for n, p in self.named_parameters() if n.endswith("norm.weight"))
        attention = 12 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * seq_len
        return 6.0 * matmul_params + attention


def build_qwen3(args: Qwen3Args, *, device: str | torch.device = "meta") -> Qwen3ForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator
    seeded by 0, parameter by parameter, in ``named_parameters`` order.
    """
    return build_causal_lm(Qwen3ForCausalLM, args, device)


__all__ = ["Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer", "build_qwen3"]
