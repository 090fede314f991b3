"""The built-in gpt-oss causal LM: transformers' module tree, meshforge's forward.

In-memory parameter names are exactly those of ``transformers.GptOssForCausalLM``
5.24: attention with biases and per-head ``self_attn.sinks``; on every layer the MoE
``mlp.router.{weight,bias}`` and the fused, transposed experts
``mlp.experts.{gate_up_proj,gate_up_proj_bias,down_proj,down_proj_bias}`` (gate/up
interleaved; see ``moe.py``). transformers also saves the experts fused, so
``hf.py`` only maps names one to one (and documents that).

Attention alternates by ``layer_types``: ``sliding_attention`` layers see the last
``sliding_window`` keys, ``full_attention`` layers all earlier keys. With
``segment_ids`` both masks are intersected with the block-diagonal causal mask of
the packed documents; sinks apply in every layer. The two masks are built once per
forward. RoPE is YaRN by default (``common/yarn.py``), or plain.

Besides logits, a forward leaves ``aux_loss()`` (the Switch load-balancing loss over
all layers, unscaled, as transformers computes it when ``output_router_logits``;
padding, ``segment_ids == 0``, excluded) and ``tokens_per_expert()``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.moe import load_balancing_loss
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.common.sink_attention import SinkAttention, causal_mask, sliding_window_mask
from meshforge.models.common.yarn import YarnRotaryEmbedding
from meshforge.models.gpt_oss.args import GptOssArgs
from meshforge.models.gpt_oss.moe import GptOssMLP


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that scales by the weight in float32 and casts after, as transformers' ``GptOssRMSNorm``.

    The shared ``RMSNorm`` follows Llama/Qwen3 (cast to the input dtype, then scale); in
    float32 the two are the same, in bf16 the order decides the rounding and, through the
    router's top-k, which experts a token reaches (measured on a tiny model: 7e-2 relative
    logits error and different expert counts with the Llama order, 9e-3 and the same
    experts with this one).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.fused:
            return super().forward(x)
        if not self.fused:
            return self._reference(x)
        return F.rms_norm(x.float(), self._shape, self.weight.float(), self.eps).to(x.dtype)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' ``GptOssRMSNorm.forward`` op by op."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + moe(norm(x))``.

    Args:
        args: Structural hyper-parameters.
        layer_idx: 0-based index (its ``layer_types`` entry picks sliding or full attention).
    """

    def __init__(self, args: GptOssArgs, layer_idx: int) -> None:
        super().__init__()
        self.attention_type = args.resolved_layer_types[layer_idx]
        sliding = self.attention_type == "sliding_attention"
        self.self_attn = SinkAttention(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.attn_head_dim,
            bias=args.attention_bias,
            sliding_window=args.sliding_window if sliding else None,
            dropout=float(args.attention_dropout),
        )
        self.mlp = GptOssMLP(
            args.hidden_size,
            args.num_local_experts,
            args.num_experts_per_tok,
            args.intermediate_size,
            alpha=args.swiglu_alpha,
            limit=args.swiglu_limit,
        )
        self.input_layernorm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x), token_mask)


def build_rotary(args: GptOssArgs) -> RotaryEmbedding:
    """The rotary embedding ``args.rope`` describes (``yarn`` or ``default``)."""
    rope = args.rope
    if rope["rope_type"] == "yarn":
        return YarnRotaryEmbedding(
            args.attn_head_dim, rope, max_position_embeddings=args.max_position_embeddings
        )
    return RotaryEmbedding(args.attn_head_dim, rope_parameters=rope)


class GptOssModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``GptOssModel``)."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.sliding_window = args.sliding_window
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(GptOssDecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = build_rotary(args)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        token_mask = None
        seq_len = input_ids.shape[-1]
        if segment_ids is not None:
            full = segment_causal_mask(segment_ids)
            token_mask = segment_ids != 0
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        else:
            full = causal_mask(seq_len, h.device)
        masks = {"full_attention": full}
        if any(layer.attention_type == "sliding_attention" for layer in self.layers):
            masks["sliding_attention"] = sliding_window_mask(full, self.sliding_window)
        rope = self.rotary_emb(position_ids, seq_len=seq_len, device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, masks[layer.attention_type], token_mask)
        return self.norm(h)


class GptOssForCausalLM(nn.Module):
    """gpt-oss decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``GptOssArgs``).
    """

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.args = args
        self.model = GptOssModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def config(self) -> GptOssArgs:
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

    def moe_layers(self) -> dict[int, GptOssMLP]:
        """The sparse blocks by decoder-layer index (every gpt-oss layer is sparse)."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers)}

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
                attention never crosses a segment boundary (sliding windows are cut there
                too) and padding is left out of the aux loss.
            return_hidden: Return the final normed hidden states ``[B, S, hidden]``
                instead of the logits (for the chunked loss, ``kernels.chunk_loss_size``).

        Returns:
            Logits ``[B, S, vocab_size]`` in the compute dtype.
        """
        hidden = self.model(input_ids, position_ids, segment_ids)
        return hidden if return_hidden else self.lm_head(hidden)

    def configure_kernels(self, options: KernelOptions) -> None:
        """Apply the kernel switches (``meshforge.models.common.kernels``).

        ``use_fused_rmsnorm`` goes to the shared norms, ``moe_grouped_gemm`` and
        ``fix_router`` to gpt-oss' own experts and routers. Flash attention cannot compute
        the per-head sinks: ``use_flash_attn: true`` is refused, ``auto`` leaves the
        explicit-softmax attention in place.

        Raises:
            ValueError: ``kernels.use_flash_attn: true``.
        """
        if options.flash_attn and options.flash_attn_strict:
            raise ValueError(
                "kernels.use_flash_attn: gpt_oss attention has per-head sink logits, which the flash "
                "and SDPA kernels do not compute (it runs an explicit softmax); unset it or use auto"
            )
        apply_kernel_options(
            self, replace(options, flash_attn=False, grouped_mm=False, fix_router=False), family="gpt_oss"
        )
        for block in self.moe_layers().values():
            block.experts.use_grouped_mm = options.grouped_mm
            block.router.fixed = options.fix_router

    def aux_loss(self) -> torch.Tensor | None:
        """Router load-balancing loss of the last forward, unscaled (float32 scalar).

        As transformers: only when ``output_router_logits`` is true, one Switch loss over
        all layers together. The trainer adds ``router_aux_loss_coef * aux_loss()``.

        Returns:
            The loss, or None when ``output_router_logits`` is false or no forward ran yet.
        """
        if not self.args.output_router_logits:
            return None
        stats = [block.last_aux_stats for block in self.moe_layers().values()]
        if any(s is None for s in stats):
            return None
        return load_balancing_loss(stats, self.args.num_local_experts)

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
        """Initialise one full (unsharded) parameter in place, as transformers' ``_init_weights`` does.

        Linear/embedding weights, the 3-D expert weights, the router weight *and bias*
        and the attention sinks ~ normal(0, ``initializer_range``) (the embedding's padding
        row zeroed when ``pad_token_id`` is set); norm weights = 1; the other biases
        (attention projections, experts) = 0. Randomness comes only from ``generator``.

        Args:
            fqn: Fully-qualified parameter name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
            tensor: The full parameter tensor, written in place.
            generator: Source of randomness.

        Raises:
            ValueError: If ``fqn`` is not a parameter name of this model.
        """
        normal_suffixes = (
            "_proj.weight",
            ".experts.gate_up_proj",
            ".experts.down_proj",
            ".mlp.router.weight",
            ".mlp.router.bias",
            ".self_attn.sinks",
        )
        if fqn.endswith("norm.weight"):
            kind = "norm"
        elif fqn.endswith(normal_suffixes) or fqn in ("lm_head.weight", "model.embed_tokens.weight"):
            kind = "normal"
        elif fqn.endswith((".bias", "_proj_bias")):
            kind = "zero"
        else:
            raise ValueError(f"init_full_parameter_: not a gpt-oss parameter name: {fqn!r}")
        with torch.no_grad():
            if kind == "zero":
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
                ``num_local_experts`` experts per layer (weights and biases).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.model.embed_tokens.weight.numel()
        if active:
            a = self.args
            for block in self.moe_layers().values():
                experts = sum(p.numel() for p in block.experts.parameters())
                total -= experts * (a.num_local_experts - a.num_experts_per_tok) // a.num_local_experts
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token over the active parameters: ``6 * N_active + 12 * L * H * D * S_eff``.

        ``N_active`` counts the matmul weights a token goes through (attention, router,
        ``num_experts_per_tok`` experts, LM head; not the embedding lookup, norms, sinks
        or biases). The attention term uses each layer's visible span: ``seq_len`` for
        full layers, ``min(seq_len, sliding_window)`` for sliding ones.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul = 0
        for name, p in self.named_parameters():
            if name.endswith(
                ("_proj.weight", ".router.weight", ".experts.gate_up_proj", ".experts.down_proj")
            ):
                matmul += p.numel()
        per_expert_share = a.num_experts_per_tok / a.num_local_experts
        experts = sum(
            b.experts.gate_up_proj.numel() + b.experts.down_proj.numel() for b in self.moe_layers().values()
        )
        matmul -= experts * (1 - per_expert_share)
        matmul += a.vocab_size * a.hidden_size  # the LM head, tied or not
        spans = [
            min(seq_len, a.sliding_window) if kind == "sliding_attention" else seq_len
            for kind in a.resolved_layer_types
        ]
        attention = 12 * a.num_attention_heads * a.attn_head_dim * sum(spans)
        return 6.0 * matmul + attention


def build_gpt_oss(args: GptOssArgs, *, device: str | torch.device = "meta") -> GptOssForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator
    seeded by the parameter's position in ``named_parameters`` order.
    """
    with torch.device(device):
        model = GptOssForCausalLM(args)
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device)
        for i, (name, param) in enumerate(model.named_parameters()):
            generator.manual_seed(i)
            model.init_full_parameter_(name, param.data, generator)
    return model


__all__ = [
    "GptOssDecoderLayer",
    "GptOssForCausalLM",
    "GptOssModel",
    "GptOssRMSNorm",
    "build_gpt_oss",
    "build_rotary",
]
