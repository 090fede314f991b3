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

from meshforge.models.common.attention import Attention, positions_from_segments, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.llama.args import LlamaArgs


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``LlamaModel``)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, rope_parameters=args.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        mask = None
        if segment_ids is not None:
            # One mask for all layers; positions restart per document unless given.
            mask = segment_causal_mask(segment_ids)
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Llama decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``LlamaArgs``).
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def config(self) -> LlamaArgs:
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
        apply_kernel_options(self, options, family="llama")

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
        if fqn.endswith("_proj.bias"):
            kind = "bias"
        elif fqn.endswith("layernorm.weight") or fqn == "model.norm.weight":
            kind = "norm"
        elif fqn.endswith("_proj.weight") or fqn in ("lm_head.weight", "model.embed_tokens.weight"):
            kind = "normal"
        else:
            raise ValueError(f"init_full_parameter_: not a Llama parameter name: {fqn!r}")
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
    with torch.device(device):
        model = LlamaForCausalLM(args)
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device)
        for i, (name, param) in enumerate(model.named_parameters()):
            generator.manual_seed(i)
            model.init_full_parameter_(name, param.data, generator)
    return model


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "build_llama"]
