"""The built-in DeepSeek-V3 causal LM: transformers' module tree, meshforge's forward.

In-memory parameter names are exactly those of ``transformers.DeepseekV3ForCausalLM`` 5.24:
multi-head latent attention (:mod:`meshforge.models.common.mla`) in every layer; the first
``first_k_dense_replace`` layers have a dense ``mlp.{gate,up,down}_proj``, the others the
sparse block of :mod:`meshforge.models.common.sigmoid_moe` (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, fused ``mlp.experts.gate_up_proj`` / ``down_proj``,
``mlp.shared_experts.*``). Safetensors use per-expert keys; ``hf.py`` maps them.

The rotary embedding spans only the ``qk_rope_head_dim`` rotated dims of each head (what
transformers calls ``head_dim`` for this family); under ``rope_type: yarn`` it is YaRN's
(blended frequencies, cos/sin gain) and the attention scale gets the ``mscale`` correction. Besides logits a forward leaves
``tokens_per_expert()`` for the monitor; ``aux_loss()`` is always None because
transformers computes no load-balancing loss for DeepSeek-V3 (balancing is the job of the
correction bias).
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import nn

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.causal_lm import DecoderModel, MoECausalLM, build_causal_lm
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.mla import MultiHeadLatentAttention
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding
from meshforge.models.common.sigmoid_moe import SharedExpertMoEBlock
from meshforge.models.common.yarn import YarnRotaryEmbedding
from meshforge.models.deepseek_v3.args import DeepseekV3Args
from meshforge.models.deepseek_v3.layer import DeepseekV3DecoderLayer
from meshforge.models.deepseek_v3.mtp import DeepseekV3MTPLayer, shift_left


class DeepseekV3Model(DecoderModel):
    """Embedding, decoder layers and final norm (transformers' ``DeepseekV3Model``).

    ``layers`` holds the ``num_hidden_layers`` decoder layers and then the
    ``num_nextn_predict_layers`` MTP blocks (``mtp.py``). A forward runs the decoder layers;
    with ``mtp_active`` (set by the trainer) and in training mode it also runs the MTP
    depths and leaves their normed hidden states in ``mtp_states``.
    """

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        n = args.num_hidden_layers
        self.layers = nn.ModuleList(
            [
                *(DeepseekV3DecoderLayer(args, i) for i in range(n)),
                *(DeepseekV3MTPLayer(args, n + d) for d in range(args.num_nextn_predict_layers)),
            ]
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = rotary_embedding(args)
        self.num_decoder_layers = n
        self.mtp_active = False
        self.mtp_states: list[torch.Tensor] = []

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
            mask = segment_causal_mask(segment_ids)
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        layers = list(self.layers)
        for layer in layers[: self.num_decoder_layers]:
            h = layer(h, rope, mask)
        h = self.norm(h)
        self.mtp_states = []
        depths = layers[self.num_decoder_layers :]
        if self.mtp_active and self.training and depths:
            if self.cp is not None:
                raise ValueError(
                    "not supported yet: multi-token prediction (model.num_nextn_predict_layers) with "
                    "parallelism.context_parallel > 1; set training.mtp_loss_scaling_factor: 0 to train without it"
                )
            state = h
            for k, block in enumerate(depths, start=1):
                # Token i + k at position i; the filled tail has no target (mtp_labels).
                state = block(self.embed_tokens(shift_left(input_ids, k, 0)), state, rope, mask)
                self.mtp_states.append(state)
        return h


def rotary_embedding(args: DeepseekV3Args) -> RotaryEmbedding:
    """The rotary table over the ``qk_rope_head_dim`` rotated dims: default RoPE or YaRN."""
    if args.rope_type == "yarn":
        assert args.rope_parameters is not None  # a yarn type comes from the dict
        return YarnRotaryEmbedding(
            args.qk_rope_head_dim,
            args.rope_parameters,
            theta=args.theta,
            max_position_embeddings=args.max_position_embeddings,
        )
    return RotaryEmbedding(args.qk_rope_head_dim, args.theta)


class DeepseekV3ForCausalLM(MoECausalLM[DeepseekV3Args]):
    """DeepSeek-V3 decoder with a language-model head; see the module docstring.

    Tying, forward, init, parameter counts (the frozen correction bias included) and
    the routing counts come from ``MoECausalLM``; ``e_score_correction_bias`` is
    initialised to 0 like the biases.

    Args:
        args: Structural hyper-parameters (``DeepseekV3Args``).
    """

    family = "deepseek_v3"
    display_name = "DeepSeek-V3"
    init_normal_suffixes = (
        "_proj.weight",
        "_proj_with_mqa.weight",
        ".experts.gate_up_proj",
        ".experts.down_proj",
        ".mlp.gate.weight",
    )
    init_zero_suffixes = (".bias", ".e_score_correction_bias")

    def __init__(self, args: DeepseekV3Args) -> None:
        super().__init__(args, DeepseekV3Model(args))
        # Logits (or, for the chunked loss, normed hidden states) of each MTP depth of the last
        # training forward with MTP active; see mtp_outputs.
        self._mtp_outputs: list[torch.Tensor] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """``CausalLM.forward``; with MTP active in training, the MTP depths run too (``mtp_outputs``)."""
        inner = cast(DeepseekV3Model, self.model)
        hidden = inner(input_ids, position_ids, segment_ids)
        states, inner.mtp_states = inner.mtp_states, []
        self._mtp_outputs = states if return_hidden else [self.lm_head(s) for s in states]
        return hidden if return_hidden else self.lm_head(hidden)

    @property
    def num_mtp_layers(self) -> int:
        """MTP depths built (``num_nextn_predict_layers``)."""
        return self.args.num_nextn_predict_layers

    def set_mtp(self, active: bool) -> None:
        """Run the MTP depths in training forwards (the trainer's ``mtp_loss_scaling_factor`` > 0)."""
        cast(DeepseekV3Model, self.model).mtp_active = active

    def mtp_outputs(self) -> list[torch.Tensor]:
        """Per depth (1..n), the last training forward's logits (hidden states with ``return_hidden``).

        Depth ``k``'s targets are ``mtp_labels(labels, k, segment_ids)``. Empty without MTP.
        Reading them clears them, so a graph is never kept past its loss.
        """
        out, self._mtp_outputs = self._mtp_outputs, []
        return out

    @property
    def num_routed_experts(self) -> int:
        return self.args.n_routed_experts

    def moe_layers(self) -> dict[int, SharedExpertMoEBlock]:
        """The sparse blocks by decoder-layer index."""
        # A layer with is_moe holds its SharedExpertMoEBlock as mlp.
        return {
            i: cast(SharedExpertMoEBlock, layer.mlp)
            for i, layer in enumerate(self.model.layers)
            if layer.is_moe
        }

    def configure_kernels(self, options: KernelOptions) -> None:
        """Apply the kernel switches (``meshforge.models.common.kernels``) to the blocks.

        The shared helper covers the norms and the fused experts; the latent attention and
        the sigmoid router are this family's own blocks and get their flags here.

        Raises:
            ValueError: ``kernels.fix_router`` or ``kernels.moe_grouped_gemm`` on a model
                without MoE layers (``first_k_dense_replace >= num_hidden_layers``).
        """
        blocks = self.moe_layers()
        if options.fix_router and not blocks:
            raise ValueError("kernels.fix_router: this deepseek_v3 model has no MoE layer; unset it")
        apply_kernel_options(self, replace(options, fix_router=False), family="deepseek_v3")
        for layer in self.model.layers:
            attn = cast(MultiHeadLatentAttention, layer.self_attn)  # every layer's attention is MLA
            attn.flash = options.flash_attn
            attn.flash_strict = options.flash_attn_strict
        for block in blocks.values():
            block.gate.fixed = options.fix_router

    def aux_loss(self) -> torch.Tensor | None:
        """Always None: transformers computes no router loss for DeepSeek-V3.

        DeepSeek-V3 balances its experts with ``e_score_correction_bias`` instead; a
        ``router_aux_loss_coef`` has nothing to scale here.
        """
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token over the active parameters: ``6 * N_active`` plus attention.

        ``N_active`` counts every matmul weight a token goes through (MLA projections,
        dense MLPs, routers, shared experts, ``num_experts_per_tok`` routed experts per MoE
        layer, the LM head; not the embedding lookup, norms or correction biases). The
        attention term is ``6 * L * H * (d_qk + d_v) * S``: the score and value products,
        forward and backward.

        Args:
            seq_len: Sequence length of the batch.
        """
        a = self.args
        matmul_params = self.num_params(exclude_embedding=True, active=True)
        if a.tie_word_embeddings:
            matmul_params += a.vocab_size * a.hidden_size
        matmul_params -= sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.endswith(("norm.weight", "e_score_correction_bias"))
        )
        head_dims = a.attn_qk_head_dim + a.v_head_dim
        layers = a.num_hidden_layers + a.num_nextn_predict_layers  # the MTP blocks attend too
        attention = 6 * layers * a.num_attention_heads * head_dims * seq_len
        return 6.0 * matmul_params + attention


def build_deepseek_v3(args: DeepseekV3Args, *, device: str | torch.device = "meta") -> DeepseekV3ForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later).

    On a real device the parameters are initialised right away with a generator seeded by
    the parameter's position in ``named_parameters`` order.
    """
    return build_causal_lm(DeepseekV3ForCausalLM, args, device)


__all__ = [
    "DeepseekV3DecoderLayer",
    "DeepseekV3ForCausalLM",
    "DeepseekV3MTPLayer",
    "DeepseekV3Model",
    "build_deepseek_v3",
]
