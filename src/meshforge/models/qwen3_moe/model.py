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

import torch
from torch import nn

from meshforge.models.common.attention import Attention, positions_from_segments, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.moe import MoEBlock, load_balancing_loss
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


class Qwen3MoeModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``Qwen3MoeModel``)."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.attn_head_dim, args.theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        mask = token_mask = None
        if segment_ids is not None:
            mask = segment_causal_mask(segment_ids)
            token_mask = segment_ids != 0
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask, token_mask)
        return self.norm(h)


class Qwen3MoeForCausalLM(nn.Module):
    """Qwen3-MoE decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``Qwen3MoeArgs``).
    """

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        if args.use_sliding_window:
            raise ValueError("use_sliding_window: not supported yet for the built-in qwen3_moe model")
        self.args = args
        self.model = Qwen3MoeModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def config(self) -> Qwen3MoeArgs:
        """The structural arguments under transformers' attribute name (``model.config.vocab_size``)."""
        return self.args

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding's parameter when ``tie_word_embeddings``.

        A no-op when already tied; re-applied after every ``_apply`` because ``to_empty``
        and ``to`` from the meta device give each module a new parameter.
        """
        if self.args.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def moe_layers(self) -> dict[int, MoEBlock]:
        """The sparse blocks by decoder-layer index."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if layer.is_moe}

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Compute next-token logits and record the routing statistics of this forward.

        Args:
            input_ids: Token ids ``[B, S]``.
            position_ids: Optional positions ``[B, S]``; default ``0..S-1``, or restarting
                at 0 per segment when ``segment_ids`` is given.
            segment_ids: Optional ``[B, S]`` document ids of packed rows (0 = padding);
                attention never crosses a segment boundary and padding is left out of
                the aux loss.
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
        apply_kernel_options(self, options, family="qwen3_moe")

    def aux_loss(self) -> torch.Tensor | None:
        """Router load-balancing loss of the last forward, unscaled (float32 scalar).

        Follows transformers: the loss exists only when ``output_router_logits`` is
        true (Qwen3-MoE's switch for it; published checkpoints ship it false), and it
        is one Switch loss over all MoE layers together. The trainer adds
        ``router_aux_loss_coef * aux_loss()``.

        Returns:
            The loss, or None when ``output_router_logits`` is false, the model has no
            MoE layer, or no forward ran yet.
        """
        if not self.args.output_router_logits:
            return None
        stats = [block.last_aux_stats for block in self.moe_layers().values()]
        if any(s is None for s in stats):
            return None
        return load_balancing_loss(stats, self.args.num_experts)

    def tokens_per_expert(self) -> dict[int, torch.Tensor]:
        """Top-k assignments per expert in the last forward: layer index -> LongTensor ``[num_experts]``.

        Every token is counted (padding too), so each layer's counts sum to
        ``tokens * num_experts_per_tok``. Layers that have not run are left out.
        """
        return {
            i: block.last_tokens_per_expert
            for i, block in self.moe_layers().items()
            if block.last_tokens_per_expert is not None
        }

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Initialise one full (unsharded) parameter in place, as transformers does.

        Linear, embedding, router and the 3-D expert weights ~ normal(0,
        ``initializer_range``) (the padding row of the embedding zeroed when
        ``pad_token_id`` is set), norm weights = 1, biases = 0. Randomness comes only
        from ``generator``.

        Args:
            fqn: Fully-qualified parameter name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
            tensor: The full parameter tensor, written in place.
            generator: Source of randomness.

        Raises:
            ValueError: If ``fqn`` is not a parameter name of this model.
        """
        if fqn.endswith(".bias"):
            kind = "bias"
        elif fqn.endswith("norm.weight"):
            kind = "norm"
        elif (
            fqn.endswith("_proj.weight")
            or fqn.endswith((".experts.gate_up_proj", ".experts.down_proj", ".mlp.gate.weight"))
            or fqn in ("lm_head.weight", "model.embed_tokens.weight")
        ):
            kind = "normal"
        else:
            raise ValueError(f"init_full_parameter_: not a Qwen3-MoE parameter name: {fqn!r}")
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

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        """Count of distinct parameters (a tied head counted once).

        Args:
            exclude_embedding: Leave out the input embedding table.
            active: Count only what one token uses: ``num_experts_per_tok`` of the
                ``num_experts`` routed experts per MoE layer.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.model.embed_tokens.weight.numel()
        if active:
            a = self.args
            for block in self.moe_layers().values():
                experts = block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
                total -= experts * (a.num_experts - a.num_experts_per_tok) // a.num_experts
        return total

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
    with torch.device(device):
        model = Qwen3MoeForCausalLM(args)
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device)
        for i, (name, param) in enumerate(model.named_parameters()):
            generator.manual_seed(i)
            model.init_full_parameter_(name, param.data, generator)
    return model


__all__ = ["Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "Qwen3MoeModel", "build_qwen3_moe"]
