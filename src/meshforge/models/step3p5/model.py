"""The built-in Step-3.5 causal LM (``Step3p5ForCausalLM`` of the published remote code).

Sources: the architecture is read from the published modelling code of stepfun-ai/Step-3.5-Flash
(``modeling_step3p5.py`` and ``configuration_step3p5.py``, the copy MindSpeed-LLM ships as
``mindspeed_llm/fsdp2/models/step35``), cross-checked with vLLM's and SGLang's ``step3p5``
implementations (head counts of sliding layers from ``attention_other_setting``, the
llama3-scaled RoPE on full layers only, the router bias). transformers 5.24 has no Step-3.5.

The module tree is the published one, so the names are its checkpoint keys, except the routed
experts, which are fused here (``moe.experts.gate_up_proj`` / ``down_proj``, for expert
parallelism and the grouped GEMM; ``hf.py`` maps them to the published ``moe.gate_proj.weight``
``[E, I, H]``, ``moe.up_proj.weight`` and ``moe.down_proj.weight`` ``[E, H, I]``):

* every norm is zero-centred (scale ``1 + weight``, weight 0 at init), eps ``rms_norm_eps``;
* attention (``self_attn``): per-layer head counts, per-head zero-centred ``q_norm``/``k_norm``,
  RoPE on the first ``rotary_dim(i)`` dims with the layer's theta (and the llama3 scaling on the
  ``yarn_only_types`` layers), a causal or sliding-window mask, then with
  ``use_head_wise_attn_gate`` each head's output times ``sigmoid(g_proj(x))`` of that head;
* feed-forward: dense layers ``mlp``; sparse layers ``moe`` (router ``moe.gate``, frozen
  ``moe.router_bias``) plus the always-on ``share_expert``; SwiGLU with the layer's clamps
  (``silu(gate)`` clamped above, ``up`` clamped both ways);
* routing in float32: sigmoid scores, the choice by ``scores + router_bias``, the weights the
  chosen unbiased scores renormalised (``+ 1e-20``) and scaled by ``moe_router_scaling_factor``.

No router aux loss exists in the published code (``aux_loss()`` is None); the assignment counts
are recorded for the monitor. Context parallelism is not built for this family.

Generation (``meshforge.infer.kv_cache``) caches each layer's rotated keys and values: every slot
on full layers, the last ``sliding_window`` on sliding ones (``Step3p5Attention.sliding_window``);
the decoder then takes one mask per layer kind from the cache. The head-wise gate reads only the
current token, so it needs nothing cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.attention import Attention, attend, positions_from_segments, segment_causal_mask
from meshforge.models.common.causal_lm import InnerModel, MoECausalLM, build_causal_lm
from meshforge.models.common.moe import (
    GroupedExperts,
    RouterStats,
    TopKRouter,
    expert_counts,
    group_sizes,
    skip_empty,
)
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding, apply_partial_rotary
from meshforge.models.common.sink_attention import causal_mask, sliding_window_mask
from meshforge.models.step3p5.args import Step3p5Args
from meshforge.utils.distributed import local_tensor


class Step3p5RMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` in float32 (the published ``Step3p5RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At least float32 (the published norm computes in float32 for bf16 and fp32 models).
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.fused:
            h = F.rms_norm(h, self._shape, None, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.weight.to(h.dtype) + 1.0)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(gate) * up`` with the published clamps (``silu(gate) <= limit``, ``|up| <= limit``)."""
    act = F.silu(gate)
    if limit is not None:
        act = act.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return act * up


class Step3p5MLP(nn.Module):
    """Dense SwiGLU MLP (``mlp`` of dense layers, ``share_expert`` of sparse ones)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Step3p5Experts(GroupedExperts):
    """The routed experts, fused (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), with a clamp.

    The expert dispatch, grouped GEMM and expert-parallel seam are the common ones; only the
    activation differs (:func:`swiglu` with the layer's ``limit``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float | None):
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.limit = limit

    def _loop(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        sizes = group_sizes(grouped, counts)
        gate_up, down = local_tensor(self.gate_up_proj).unbind(0), local_tensor(self.down_proj).unbind(0)
        outputs = []
        for expert, group in enumerate(torch.split(grouped, sizes)):
            if skip_empty(group):
                continue
            gate, up = F.linear(group, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(swiglu(gate, up, self.limit), down[expert]))
        if not outputs:  # an empty output that still reaches the weights (see GroupedExperts)
            gate, up = F.linear(grouped, gate_up[0]).chunk(2, dim=-1)
            return F.linear(swiglu(gate, up, self.limit), down[0])
        return torch.cat(outputs)

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        if grouped.shape[0] == 0:
            return self._loop(grouped, counts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate, up = F.grouped_mm(grouped, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(swiglu(gate, up, self.limit), down.transpose(1, 2), offs=offsets)


class Step3p5Router(TopKRouter):
    """Linear router ``moe.gate`` with sigmoid scores, steered by the block's ``router_bias``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scaling: float) -> None:
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=True)
        self.scaling = scaling

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[N, hidden]``: ``(scores [N, E], float32 weights [N, k], indices [N, k])``."""
        # At least float32, as the published code (need_fp32_gate) computes the router.
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = F.linear(x.to(dtype), self.weight.to(dtype)).sigmoid()
        with torch.no_grad():
            if self.fixed:
                slots = torch.arange(scores.shape[0] * self.top_k, device=scores.device)
                indices = (slots % self.num_experts).view(-1, self.top_k)
            else:
                biased = scores if bias is None else scores + bias.to(dtype)
                indices = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, indices


class Step3p5MoE(nn.Module):
    """``moe``: router ``gate``, frozen ``router_bias`` (when used) and the fused experts."""

    def __init__(self, args: Step3p5Args, layer: int) -> None:
        super().__init__()
        self.gate = Step3p5Router(
            args.hidden_size, args.moe_num_experts, args.moe_top_k, args.moe_router_scaling_factor
        )
        self.experts = Step3p5Experts(
            args.moe_num_experts,
            args.hidden_size,
            args.moe_intermediate_size,
            args.swiglu_limit(layer, shared=False),
        )
        self.router_bias = (
            nn.Parameter(torch.zeros(args.moe_num_experts), requires_grad=False)
            if args.use_moe_router_bias
            else None
        )
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_aux_stats: RouterStats | None = None  # no aux loss for this family

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        _, weights, indices = self.gate(tokens, self.router_bias)
        with torch.no_grad():
            counts = expert_counts(indices, self.gate.num_experts)
        self.last_tokens_per_expert = counts
        return self.experts(tokens, indices, weights, counts).to(x.dtype).view(shape)


class Step3p5Attention(Attention):
    """Attention of one layer: its own heads, RoPE, window and optional head-wise gate."""

    q_norm: Step3p5RMSNorm
    k_norm: Step3p5RMSNorm

    def __init__(self, args: Step3p5Args, layer: int) -> None:
        heads, kv_heads = args.layer_heads(layer)
        super().__init__(args.hidden_size, heads, kv_heads, args.head_dim, bias=False, qk_norm=False)
        self.q_norm = Step3p5RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = Step3p5RMSNorm(args.head_dim, args.rms_norm_eps)
        self.g_proj = nn.Linear(args.hidden_size, heads, bias=False) if args.use_head_wise_attn_gate else None
        self.rotary_dim = args.rotary_dim(layer)
        self.rotary_emb = RotaryEmbedding(
            self.rotary_dim, args.layer_theta(layer), rope_parameters=_rope_parameters(args, layer)
        )
        # The keys a sliding layer's queries see (None on full layers, and on sliding layers
        # without a window, which attend like full ones); the generation cache keeps as many.
        sliding = args.layer_kind(layer) == "sliding_attention"
        self.sliding_window = args.sliding_window if sliding else None

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, positions: torch.Tensor | None, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attend over ``x`` ``[B, S, hidden]`` with a boolean ``mask`` ``[B or 1, 1, S, S]``."""
        batch, seq_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq_len, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(positions, seq_len=seq_len, device=x.device, dtype=x.dtype)
        q = apply_partial_rotary(q, cos, sin, self.rotary_dim).transpose(1, 2)
        k = apply_partial_rotary(k, cos, sin, self.rotary_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache(k, v)
        # The shared core without the flash switch (the mask is always a tensor here) or CP
        # (refused for step3p5); it adds the kernels.pre_tokens band to the layer's mask.
        out = attend(q, k, v, mask, scale=self.scaling, pre_tokens=self.pre_tokens).transpose(1, 2)
        if self.g_proj is not None:
            out = out * self.g_proj(x).sigmoid().unsqueeze(-1)
        return self.o_proj(out.reshape(batch, seq_len, -1))


def _rope_parameters(args: Step3p5Args, layer: int) -> dict[str, object] | None:
    scaling = args.layer_rope_scaling(layer)
    if scaling is None:
        return None
    params = dict(scaling)
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    params["rope_theta"] = args.layer_theta(layer)
    return params


class Step3p5DecoderLayer(nn.Module):
    """Pre-norm block; the feed-forward is ``mlp`` (dense) or ``moe`` + ``share_expert`` (sparse)."""

    def __init__(self, args: Step3p5Args, layer: int) -> None:
        super().__init__()
        self.attention_type = args.layer_kind(layer)
        self.self_attn = Step3p5Attention(args, layer)
        self.is_moe = args.is_moe_layer(layer)
        shared_limit = args.swiglu_limit(layer, shared=True)
        self.moe: Step3p5MoE | None = None
        self.share_expert: Step3p5MLP | None = None
        if self.is_moe:
            self.moe = Step3p5MoE(args, layer)
            self.share_expert = Step3p5MLP(args.hidden_size, args.share_expert_dim, shared_limit)
        else:
            # Registered directly (what add_module does): `mlp` is also the property below.
            self._modules["mlp"] = Step3p5MLP(args.hidden_size, args.intermediate_size, shared_limit)
        self.input_layernorm = Step3p5RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = Step3p5RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:
        """The dense MLP, or on a sparse layer its routed block ``moe``.

        The shared MoE code of pipeline stages reads a layer's sparse block as ``layer.mlp``
        (the name the other families use); the module tree keeps the published names.
        """
        block = self._modules.get("mlp") or self._modules.get("moe")
        if block is None:  # during __init__
            raise AttributeError("mlp")
        return block

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None, masks: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, masks[self.attention_type])
        h = self.post_attention_layernorm(x)
        if self.moe is not None and self.share_expert is not None:
            return x + (self.moe(h) + self.share_expert(h))
        return x + self.mlp(h)


def layer_masks(
    layers: list[nn.Module],
    segment_ids: torch.Tensor | None,
    seq_len: int,
    device: torch.device,
    window: int | None,
) -> dict[str, torch.Tensor]:
    """The boolean masks the given layers need: causal (per document) and its sliding-window band."""
    full = segment_causal_mask(segment_ids) if segment_ids is not None else causal_mask(seq_len, device)
    masks = {"full_attention": full}
    if any(getattr(layer, "attention_type", None) == "sliding_attention" for layer in layers):
        # Without a window a sliding layer attends like a full one (the published code's rule).
        masks["sliding_attention"] = full if window is None else sliding_window_mask(full, window)
    return masks


class Step3p5Model(InnerModel):
    """Embedding, decoder layers and final norm (the published ``Step3p5Model``)."""

    # Set by meshforge.infer.kv_cache during cached generation: this forward's boolean masks by
    # layer kind over every cached key (a sliding layer's over its window); None in training.
    decode_mask: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None

    def __init__(self, args: Step3p5Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(Step3p5DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = Step3p5RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.sliding_window = args.sliding_window

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if segment_ids is not None and position_ids is None:
            position_ids = positions_from_segments(segment_ids)
        layers = list(self.layers)
        if self.decode_mask is not None:
            masks = self.decode_mask(input_ids)
            # Sliding layers without a window attend like full ones (as in layer_masks).
            masks.setdefault("sliding_attention", masks["full_attention"])
        else:
            masks = layer_masks(layers, segment_ids, input_ids.shape[-1], h.device, self.sliding_window)
        for layer in layers:
            h = layer(h, position_ids, masks)
        return self.norm(h)


class Step3p5ForCausalLM(MoECausalLM[Step3p5Args]):
    """Step-3.5 decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``Step3p5Args``).
    """

    family = "step3p5"
    display_name = "Step-3.5"
    init_normal_suffixes = ("_proj.weight", ".experts.gate_up_proj", ".experts.down_proj", ".moe.gate.weight")
    init_norm_suffixes = ()
    init_zero_suffixes = ("norm.weight", ".router_bias")

    def __init__(self, args: Step3p5Args) -> None:
        super().__init__(args, Step3p5Model(args))

    @property
    def num_routed_experts(self) -> int:
        return self.args.moe_num_experts

    def moe_layers(self) -> dict[int, Step3p5MoE]:
        """The sparse blocks (``moe``) by decoder-layer index."""
        return {i: cast(Step3p5MoE, layer.moe) for i, layer in enumerate(self.model.layers) if layer.is_moe}

    def aux_loss(self) -> torch.Tensor | None:
        """Always None: the published Step-3.5 code computes no router loss (the bias balances)."""
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """``6 * N_active`` plus attention (``12 * S * H_i * D`` per layer, the window on sliding ones)."""
        a = self.args
        matmul_params = self.num_params(exclude_embedding=True, active=True)
        if a.tie_word_embeddings:
            matmul_params += a.vocab_size * a.hidden_size
        matmul_params -= sum(
            p.numel() for n, p in self.named_parameters() if n.endswith(("norm.weight", "router_bias"))
        )
        attention = 0
        for i in range(a.num_hidden_layers):
            span = seq_len
            if a.layer_kind(i) == "sliding_attention" and a.sliding_window is not None:
                span = min(seq_len, a.sliding_window)
            attention += 12 * a.layer_heads(i)[0] * a.head_dim * span
        return 6.0 * matmul_params + attention


def build_step3p5(args: Step3p5Args, *, device: str | torch.device = "meta") -> Step3p5ForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later)."""
    return build_causal_lm(Step3p5ForCausalLM, args, device)


__all__ = [
    "Step3p5Attention",
    "Step3p5DecoderLayer",
    "Step3p5Experts",
    "Step3p5ForCausalLM",
    "Step3p5MLP",
    "Step3p5MoE",
    "Step3p5Model",
    "Step3p5RMSNorm",
    "Step3p5Router",
    "build_step3p5",
    "layer_masks",
]
