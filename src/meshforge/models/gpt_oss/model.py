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

Under context parallelism (``cp`` set by ``meshforge.parallel.context.apply_cp``) the
inner model asks the CP plan for one per-forward mask object and the global positions;
every layer passes it on, and the attention's CP callable applies the layer's window.

Besides logits, a forward leaves ``aux_loss()`` (the Switch load-balancing loss over
all layers, unscaled, as transformers computes it when ``output_router_logits``;
padding, ``segment_ids == 0``, excluded) and ``tokens_per_expert()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.causal_lm import InnerModel, MoECausalLM, RoutedBlock, build_causal_lm
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.common.sink_attention import SinkAttention, causal_mask, sliding_window_mask
from meshforge.models.common.yarn import YarnRotaryEmbedding
from meshforge.models.gpt_oss.args import GptOssArgs
from meshforge.models.gpt_oss.moe import GptOssMLP

if TYPE_CHECKING:
    from meshforge.models.spec import CPPlan


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
        assert args.num_key_value_heads is not None  # GptOssArgs.__post_init__ fills it
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


class GptOssModel(InnerModel):
    """Embedding, decoder layers and final norm (transformers' ``GptOssModel``)."""

    # Set by meshforge.parallel.context.apply_cp: builds the per-forward CP mask object
    # (and global positions) instead of the local [S, S] masks; None without CP.
    cp: CPPlan | None = None
    # Set by meshforge.infer.kv_cache during cached generation: the boolean masks of this
    # forward's queries over the keys each kind of layer attends (``full_attention``: every
    # cached slot; ``sliding_attention``: the slots its window cache holds); None in training.
    decode_mask: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None

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
        masks: dict[str, object]
        if self.decode_mask is not None:
            return self._layers(h, position_ids, self.decode_mask(input_ids), None, seq_len)
        if self.cp is not None:
            # Context parallel: one mask object for both kinds of layer; each attention
            # applies its own window in global positions.
            cp_mask, position_ids = self.cp.prepare(input_ids, position_ids, segment_ids)
            masks = {"full_attention": cp_mask, "sliding_attention": cp_mask}
            if segment_ids is not None:
                token_mask = segment_ids != 0
            return self._layers(h, position_ids, masks, token_mask, input_ids.shape[-1])
        if segment_ids is not None:
            full = segment_causal_mask(segment_ids)
            token_mask = segment_ids != 0
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        else:
            full = causal_mask(seq_len, h.device)
        masks = {"full_attention": full}
        if any(layer.attention_type == "sliding_attention" for layer in self.layers):
            assert self.sliding_window is not None  # GptOssArgs requires it when a layer slides
            masks["sliding_attention"] = sliding_window_mask(full, self.sliding_window)
        return self._layers(h, position_ids, masks, token_mask, seq_len)

    def _layers(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor | None,
        masks: Mapping[str, object],
        token_mask: torch.Tensor | None,
        seq_len: int,
    ) -> torch.Tensor:
        # The row's length from the input ids: under sequence parallelism the embedding output
        # `h` holds only this rank's slice of the sequence.
        rope = self.rotary_emb(position_ids, seq_len=seq_len, device=h.device, dtype=h.dtype)
        for layer in self.layers:
            # Each layer is a GptOssDecoderLayer, whose attention_type names its mask.
            h = layer(h, rope, masks[cast(str, layer.attention_type)], token_mask)
        return self.norm(h)


class GptOssForCausalLM(MoECausalLM[GptOssArgs]):
    """gpt-oss decoder with a language-model head; see the module docstring.

    Tying, forward, init, parameter counts, the aux loss and the routing counts come
    from ``MoECausalLM``. Init as transformers' ``_init_weights``: besides the linear
    and embedding weights, the 3-D expert weights, the router weight *and bias* and
    the attention sinks are normal(0, ``initializer_range``); the other biases
    (attention projections, experts) are 0.

    Args:
        args: Structural hyper-parameters (``GptOssArgs``).
    """

    family = "gpt_oss"
    display_name = "gpt-oss"
    # Checked before the zero rule, so ``.mlp.router.bias`` is drawn, not zeroed.
    init_normal_suffixes = (
        "_proj.weight",
        ".experts.gate_up_proj",
        ".experts.down_proj",
        ".mlp.router.weight",
        ".mlp.router.bias",
        ".self_attn.sinks",
    )
    init_zero_suffixes = (".bias", "_proj_bias")

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args, GptOssModel(args))

    @property
    def num_routed_experts(self) -> int:
        return self.args.num_local_experts

    def moe_layers(self) -> dict[int, GptOssMLP]:
        """The sparse blocks by decoder-layer index (every gpt-oss layer is sparse)."""
        return {i: cast(GptOssMLP, layer.mlp) for i, layer in enumerate(self.model.layers)}

    def _expert_numel(self, block: RoutedBlock) -> int:
        # gpt-oss experts carry biases too; a token uses k of E of those as well.
        return sum(p.numel() for p in block.experts.parameters())

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
        matmul: float = 0
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
        # sliding_window is None only when no layer slides (GptOssArgs checks it).
        window = seq_len if a.sliding_window is None else min(seq_len, a.sliding_window)
        spans = [window if kind == "sliding_attention" else seq_len for kind in a.resolved_layer_types]
        attention = 12 * a.num_attention_heads * a.attn_head_dim * sum(spans)
        return 6.0 * matmul + attention


def build_gpt_oss(args: GptOssArgs, *, device: str | torch.device = "meta") -> GptOssForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator
    seeded by the parameter's position in ``named_parameters`` order.
    """
    return build_causal_lm(GptOssForCausalLM, args, device)


__all__ = [
    "GptOssDecoderLayer",
    "GptOssForCausalLM",
    "GptOssModel",
    "GptOssRMSNorm",
    "build_gpt_oss",
    "build_rotary",
]
