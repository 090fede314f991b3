"""The built-in Llama causal LM (Llama 3 / 3.1 / 3.2): transformers' module tree, meshforge's forward.

Parameter names are exactly those of ``transformers.LlamaForCausalLM``
(``model.layers.{i}.self_attn.q_proj.weight``, ``model.layers.{i}.mlp.gate_proj.bias``
when ``mlp_bias``, ``lm_head.weight``, ...), so HF state dicts load without renaming
and module patterns mean the same for both. Compared with Qwen3 the block has no
q/k norm, optional biases on the MLP as well as on attention, and RoPE may be the
``llama3`` scaled type; the forward contract is the same as the other built-in
families: no cache or output plumbing, causal SDPA without a mask tensor unless
documents are packed, RoPE tables cached across steps, logits in the compute dtype
(the loss and its float32 upcast belong to the trainer).
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.causal_lm import CausalLM, DecoderModel, InitKind, build_causal_lm
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.llama.args import LlamaArgs


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        # LlamaArgs.__post_init__ replaces a None of either by its derived value.
        assert args.num_key_value_heads is not None and args.head_dim is not None
        self.self_attn = Attention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm=False,
            dropout=float(args.attention_dropout),
        )
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, bias=args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(DecoderModel):
    """Embedding, decoder layers and final norm (transformers' ``LlamaModel``)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        assert args.head_dim is not None  # LlamaArgs.__post_init__ derives it
        self.rotary_emb = RotaryEmbedding(args.head_dim, rope_parameters=args.rope)


class LlamaForCausalLM(CausalLM[LlamaArgs]):
    """Llama decoder with a language-model head; see the module docstring.

    Tying, forward, kernel switches, init and parameter counts come from ``CausalLM``.

    Args:
        args: Structural hyper-parameters (``LlamaArgs``).
    """

    family = "llama"
    display_name = "Llama"
    init_norm_suffixes = ("layernorm.weight",)
    init_zero_suffixes = ("_proj.bias",)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args, LlamaModel(args))

    def _init_kind(self, fqn: str) -> InitKind | None:
        # The final norm is the one norm whose name does not end in ``layernorm.weight``.
        return "norm" if fqn == "model.norm.weight" else super()._init_kind(fqn)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 * N + 12 * L * H * D * S``.

        ``N`` counts every matmul weight including the LM head (a tied head still does
        its matmul) but neither the embedding lookup, norm weights nor biases; the
        second term is the QK^T and attention-times-V products (forward
        ``2 * 2 * S * H * D`` per token and layer, times 3 for forward plus backward),
        without halving for causality.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul_params = sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.endswith("_proj.weight") or n == "lm_head.weight"
        )
        if a.tie_word_embeddings:
            # named_parameters lists the shared tensor once, under the embedding's name.
            matmul_params += a.vocab_size * a.hidden_size
        assert a.head_dim is not None  # LlamaArgs.__post_init__ derives it
        attention = 12 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * seq_len
        return 6.0 * matmul_params + attention


def build_llama(args: LlamaArgs, *, device: str | torch.device = "meta") -> LlamaForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away, parameter ``i`` of
    ``named_parameters`` from a generator seeded with ``i``.

    Args:
        args: Structural hyper-parameters.
        device: Where to allocate; ``"meta"`` allocates nothing.

    Returns:
        The model (tied head already tied).
    """
    return build_causal_lm(LlamaForCausalLM, args, device)


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "build_llama"]
