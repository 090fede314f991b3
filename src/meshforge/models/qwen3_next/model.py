"""The built-in Qwen3-Next causal LM: hybrid Gated DeltaNet + gated attention, transformers' tree.

In-memory parameter names are exactly those of ``transformers.Qwen3NextForCausalLM`` 5.24.
``layer_types`` decides each layer's token mixer: ``linear_attn`` (Gated DeltaNet,
``gdn.py``) or ``self_attn`` (gated attention: ``q_proj`` emits per head the query
followed by an output gate, ``sigmoid(gate)`` multiplies the attention output before
``o_proj``; q/k RMSNorm; RoPE on the first ``partial_rotary_factor`` of each head).
The feed-forward is the sparse block (softmax top-k router, fused experts, plus a
shared expert scaled by ``sigmoid(shared_expert_gate(x))``) or, on ``mlp_only_layers``
and off the ``decoder_sparse_step``, a dense SwiGLU. Every RMSNorm outside the gated
one is zero-centred: ``x_normed * (1 + weight)`` with weights initialised to zero.

Packed rows (``segment_ids``): attention gets the block-diagonal causal mask, the
Gated DeltaNet layers restart their recurrent state and conv window at every document
start, positions restart per document unless ``position_ids`` are given. Besides
logits, a forward leaves ``aux_loss()`` (with ``output_router_logits``) and
``tokens_per_expert()`` as for Qwen3-MoE.

Context parallelism (ulysses, the reference's only method for this family): the gated
attention layers call the CP plan like every ``Attention``; the Gated DeltaNet layers
trade sequence for key-head groups with their own all-to-alls (``gdn.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.attention import Attention, positions_from_segments, segment_causal_mask
from meshforge.models.common.causal_lm import InitKind, InnerModel, MoECausalLM, build_causal_lm
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.moe import MoEBlock
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding, apply_partial_rotary
from meshforge.models.qwen3_next.args import Qwen3NextArgs
from meshforge.models.qwen3_next.gdn import GatedDeltaNet

if TYPE_CHECKING:
    from meshforge.models.spec import CPPlan

# The chunk length the FLOPs estimate assumes (the default of kernels.gdn_chunk_size).
_FLOPS_GDN_CHUNK = 64

# Parameters a token multiplies with (besides routed experts and the LM head), for the FLOPs count.
_MATMUL_SUFFIXES = (
    "_proj.weight",
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "mlp.gate.weight",
    "shared_expert_gate.weight",
)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` in float32 (transformers' ``Qwen3NextRMSNorm``); weight 0 at init."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.fused:
            h = F.rms_norm(h, self._shape, None, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(Attention):
    """Grouped-query attention with a sigmoid output gate and partial RoPE (``Qwen3NextAttention``).

    ``q_proj`` is twice as wide as the heads: per head, ``head_dim`` query values then
    ``head_dim`` gate values. The flash-attention kernel switch applies as in
    :class:`~meshforge.models.common.attention.Attention`.

    Args:
        args: Structural hyper-parameters.
    """

    q_norm: ZeroCenteredRMSNorm
    k_norm: ZeroCenteredRMSNorm

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm=False,
            dropout=float(args.attention_dropout),
        )
        self.q_proj = nn.Linear(
            args.hidden_size, 2 * args.num_attention_heads * args.head_dim, bias=args.attention_bias
        )
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, args.rms_norm_eps)
        self.rotary_dim = args.rotary_dim

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | object,
    ) -> torch.Tensor:
        """Attend over ``x`` ``[B, S, hidden]``; ``mask`` is None (causal) or boolean ``[B, 1, S, S]``.

        Under context parallelism ``mask`` is the decoder's CPMask and ``rope`` holds the
        global positions of this rank's tokens.
        """
        batch, seq_len, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq_len, -1, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(batch, seq_len, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        cos, sin = rope
        q = apply_partial_rotary(q, cos, sin, self.rotary_dim).transpose(1, 2)
        k = apply_partial_rotary(k, cos, sin, self.rotary_dim).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache(k, v)
        # Under context parallelism the plan's attention over the CPMask; the output gate is per
        # token and head, applied locally as on one process.
        out = self._attend(q, k, v, mask).transpose(1, 2).reshape(batch, seq_len, -1)
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3NextSparseMoeBlock(MoEBlock):
    """Routed experts (the common :class:`MoEBlock`) plus a gated shared expert.

    ``shared_expert`` is a SwiGLU of width ``shared_expert_intermediate_size`` that
    every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``.

    Args:
        args: Structural hyper-parameters.
    """

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__(
            args.hidden_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.moe_intermediate_size,
            norm_topk_prob=args.norm_topk_prob,
            hidden_act=args.hidden_act,
        )
        self.shared_expert = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, args.hidden_act)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        routed = super().forward(x, token_mask)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        args: Structural hyper-parameters.
        layer_idx: 0-based index; picks the mixer (``layer_types``) and dense versus sparse.
    """

    def __init__(self, args: Qwen3NextArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = args.resolved_layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                args.hidden_size,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                conv_kernel_size=args.linear_conv_kernel_dim,
                hidden_act=args.hidden_act,
                norm_eps=args.rms_norm_eps,
            )
        else:
            self.self_attn = GatedAttention(args)
        self.is_moe = args.is_moe_layer(layer_idx)
        self.mlp: Qwen3NextSparseMoeBlock | GatedMLP
        if self.is_moe:
            self.mlp = Qwen3NextSparseMoeBlock(args)
        else:
            self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One block; ``mask`` for attention layers, ``segment_ids`` for the DeltaNet and the router stats.

        Under context parallelism ``mask`` is the CPMask (the DeltaNet reads the full-row
        document ids from it) and ``segment_ids`` this rank's slice.
        """
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            if self.linear_attn.cp is None:
                x = x + self.linear_attn(h, segment_ids)
            else:
                x = x + self.linear_attn(h, segment_ids, mask)
        else:
            x = x + self.self_attn(h, rope, mask)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            return x + self.mlp(h, None if segment_ids is None else segment_ids != 0)
        return x + self.mlp(h)


class Qwen3NextModel(InnerModel):
    """Embedding, hybrid decoder layers and final norm (transformers' ``Qwen3NextModel``).

    Under context parallelism (``cp`` set by ``meshforge.parallel.context.apply_cp``,
    ulysses) the plan's ``prepare`` builds one CPMask per forward (full-row document ids,
    global positions) that both kinds of layer read.
    """

    # Set by meshforge.parallel.context.apply_cp; None without CP.
    cp: CPPlan | None = None
    # Set by meshforge.infer.kv_cache during cached generation: the attention layers' boolean mask
    # over every cached key (or None); the Gated DeltaNet layers read their padding from their own
    # state cache. None in training.
    decode_mask: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.rotary_dim, args.theta)
        self._has_attention = "full_attention" in args.resolved_layer_types

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        mask: torch.Tensor | object = None  # or the CP plan's mask object
        if self.decode_mask is not None:
            mask = self.decode_mask(input_ids)
        elif self.cp is not None:
            mask, position_ids = self.cp.prepare(input_ids, position_ids, segment_ids)
        elif segment_ids is not None:
            # Attention gets one block-diagonal mask; the DeltaNet layers read segment_ids directly.
            if self._has_attention:
                mask = segment_causal_mask(segment_ids)
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask, segment_ids)
        return self.norm(h)


class Qwen3NextForCausalLM(MoECausalLM[Qwen3NextArgs]):
    """Qwen3-Next with a language-model head; see the module docstring.

    Tying, forward, init, parameter counts, the aux loss and the routing counts come
    from ``MoECausalLM``; this class adds the zero-centred norms and the DeltaNet
    parameters to the init rules and the ``gdn_chunk_size`` switch.

    Args:
        args: Structural hyper-parameters (``Qwen3NextArgs``).
    """

    family = "qwen3_next"
    display_name = "Qwen3-Next"
    init_normal_suffixes = (
        "_proj.weight",
        ".experts.gate_up_proj",
        ".experts.down_proj",
        ".mlp.gate.weight",
        ".shared_expert_gate.weight",
        ".conv1d.weight",
        ".in_proj_qkvz.weight",
        ".in_proj_ba.weight",
    )

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__(args, Qwen3NextModel(args))

    @property
    def num_routed_experts(self) -> int:
        return self.args.num_experts

    def moe_layers(self) -> dict[int, MoEBlock]:
        """The sparse blocks by decoder-layer index."""
        # A layer with is_moe holds its Qwen3NextSparseMoeBlock as mlp.
        return {i: cast(MoEBlock, layer.mlp) for i, layer in enumerate(self.model.layers) if layer.is_moe}

    def configure_kernels(self, options: KernelOptions) -> None:
        """The common switches, plus ``gdn_chunk_size`` on every Gated DeltaNet layer.

        The Triton/Ascend Gated DeltaNet switches never reach here: the config refuses them as
        "not supported yet" (config/unsupported.py).

        Raises:
            ValueError: a ``gdn_chunk_size`` that is not positive.
        """
        apply_kernel_options(self, options, family=self.family)
        chunk = options.gdn_chunk_size
        if chunk is not None:
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
                raise ValueError(f"kernels.gdn_chunk_size: must be a positive integer, got {chunk!r}")
            for module in self.modules():
                if isinstance(module, GatedDeltaNet):
                    module.chunk_size = chunk

    def _init_kind(self, fqn: str) -> InitKind | None:
        # Zero-centred norms (scale 1 + weight) start at 0; the gated norm of the DeltaNet at 1.
        if fqn.endswith("linear_attn.norm.weight") or fqn.endswith(".dt_bias"):
            return "norm"
        if fqn.endswith("norm.weight"):
            return "zero"
        return super()._init_kind(fqn)

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """As :meth:`CausalLM.init_full_parameter_`, with transformers' Qwen3-Next rules on top.

        Zero-centred norms = 0, the gated norm and ``dt_bias`` = 1, ``A_log`` = log of
        uniform(0.01, 16) (so the decay rate ``exp(A_log)`` is never 0), conv weights and
        the shared-expert gate ~ normal(0, ``initializer_range``).
        """
        if fqn.endswith(".A_log"):
            with torch.no_grad():
                tensor.uniform_(0.01, 16.0, generator=generator).log_()
            return
        super().init_full_parameter_(fqn, tensor, generator)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token over the active parameters: ``6 * N_active`` plus attention.

        ``N_active`` counts the matmul weights a token goes through (projections, dense
        MLPs, routers, shared experts, ``num_experts_per_tok`` routed experts, the LM
        head; not the embedding lookup, norms, conv or decay parameters). The full
        attention layers add ``12 * H * D * S`` each, as in Qwen3; each Gated DeltaNet
        layer adds ``6 * Hv * (3 * Dk * Dv + C * (2 * Dk + Dv))`` for its chunked rule:
        three state products per token (read by queries, read by the write, update) and
        three in-chunk products (``K K^T``, ``Q K^T``, scores times writes), with ``C`` the
        default chunk of 64; the triangular solve is left out.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul = sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.endswith(_MATMUL_SUFFIXES) and "embed_tokens" not in n
        )
        for block in self.moe_layers().values():
            n, k = a.num_experts, a.num_experts_per_tok
            matmul += (block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()) * k // n
        matmul += a.vocab_size * a.hidden_size  # the LM head, tied or not
        kinds = a.resolved_layer_types
        attention = 12 * kinds.count("full_attention") * a.num_attention_heads * a.head_dim * seq_len
        dk, dv, chunk = a.linear_key_head_dim, a.linear_value_head_dim, _FLOPS_GDN_CHUNK
        per_gdn = 6 * a.linear_num_value_heads * (3 * dk * dv + chunk * (2 * dk + dv))
        return 6.0 * matmul + attention + kinds.count("linear_attention") * per_gdn


def build_qwen3_next(args: Qwen3NextArgs, *, device: str | torch.device = "meta") -> Qwen3NextForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator
    seeded by the parameter's position in ``named_parameters`` order.
    """
    return build_causal_lm(Qwen3NextForCausalLM, args, device)


__all__ = [
    "GatedAttention",
    "Qwen3NextDecoderLayer",
    "Qwen3NextForCausalLM",
    "Qwen3NextModel",
    "Qwen3NextSparseMoeBlock",
    "ZeroCenteredRMSNorm",
    "build_qwen3_next",
]
