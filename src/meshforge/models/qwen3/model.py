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

from meshforge.models.common.attention import Attention, positions_from_segments, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.qwen3.args import Qwen3Args


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
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


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``Qwen3Model``)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        mask = None
        if segment_ids is not None:
            mask = segment_causal_mask(segment_ids)
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``Qwen3Args``).
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        if args.uses_sliding_window:
            raise ValueError("use_sliding_window: not supported yet for the built-in qwen3 model")
        self.args = args
        self.model = Qwen3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def config(self) -> Qwen3Args:
        """The structural arguments under transformers' attribute name (``model.config.vocab_size``)."""
        return self.args

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding's parameter when ``tie_word_embeddings``.

        One tensor under two names, as transformers ties them. A no-op when already
        tied. Called again after every ``_apply`` because ``to_empty`` (and ``to``) from
        the meta device gives each module its own new parameter, silently untying.
        """
        if self.args.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            input_ids: Token ids ``[B, S]``.
            position_ids: Optional positions ``[B, S]``; default ``0..S-1``, or restarting
                at 0 per segment when ``segment_ids`` is given.
            segment_ids: Optional ``[B, S]`` document ids of packed rows (0 = padding);
                attention never crosses a segment boundary.
            return_hidden: Return the final normed hidden states ``[B, S, hidden]``
                instead of the logits (for the chunked loss).

        Returns:
            Logits ``[B, S, vocab_size]`` in the compute dtype.
        """
        hidden = self.model(input_ids, position_ids, segment_ids)
        # The chunked loss (kernels.chunk_loss_size) applies lm_head itself, chunk by chunk.
        return hidden if return_hidden else self.lm_head(hidden)

    def configure_kernels(self, options: KernelOptions) -> None:
        """Apply the kernel switches (``meshforge.models.common.kernels``) to the blocks."""
        apply_kernel_options(self, options, family="qwen3")

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Initialise one full (unsharded) parameter in place, as transformers does.

        Linear and embedding weights ~ normal(0, ``initializer_range``) (the padding
        row of the embedding zeroed when ``pad_token_id`` is set), norm weights = 1,
        biases = 0. Randomness comes only from ``generator``, so a trainer that seeds
        one generator per parameter and keeps its local shard gets the weights a
        single process would.

        Args:
            fqn: Fully-qualified parameter name, e.g. ``model.layers.0.mlp.up_proj.weight``.
            tensor: The full parameter tensor (on the generator's device), written in place.
            generator: Source of randomness.

        Raises:
            ValueError: If ``fqn`` is not a parameter name of this model.
        """
        leaf = fqn.rsplit(".", 2)
        if fqn.endswith(".bias"):
            kind = "bias"
        elif fqn.endswith("norm.weight"):
            kind = "norm"
        elif fqn.endswith("_proj.weight") or fqn in ("lm_head.weight", "model.embed_tokens.weight"):
            kind = "normal"
        else:
            raise ValueError(f"init_full_parameter_: not a Qwen3 parameter name: {fqn!r} ({leaf[-1]})")
        with torch.no_grad():
            if kind == "bias":
                tensor.zero_()
            elif kind == "norm":
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, self.args.initializer_range, generator=generator)
                pad = self.args.pad_token_id
                if fqn == "model.embed_tokens.weight" and pad is not None:
                    tensor[pad].zero_()

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Count of distinct parameters (a tied head counted once).

        Args:
            exclude_embedding: Leave out the input embedding table.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.model.embed_tokens.weight.numel()
        return total

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
    with torch.device(device):
        model = Qwen3ForCausalLM(args)
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device)
        for i, (name, param) in enumerate(model.named_parameters()):
            generator.manual_seed(i)
            model.init_full_parameter_(name, param.data, generator)
    return model


__all__ = ["Qwen3ForCausalLM", "Qwen3Model", "Qwen3DecoderLayer", "build_qwen3"]
