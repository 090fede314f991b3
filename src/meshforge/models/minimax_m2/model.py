"""The built-in MiniMax-M2 causal LM: transformers' module tree, meshforge's forward.

In-memory parameter names are exactly those of ``transformers.MiniMaxM2ForCausalLM`` 5.24. Every
layer is sparse; what sets the family apart from Qwen3-MoE:

* attention: ``q_norm`` / ``k_norm`` are RMSNorms over the *whole* projection width
  (``num_heads * head_dim``, all heads together), applied before the heads are split, and
  RoPE rotates only the first ``rotary_dim`` dims of each head (``partial_rotary_factor``);
* routing: sigmoid scores in float32; the choice uses ``scores + mlp.e_score_correction_bias``
  (a bias on the block, not on the router), the weights are the unbiased scores of the
  chosen experts renormalised to sum to one; the experts' width is ``intermediate_size``.

``e_score_correction_bias`` is a frozen parameter here (a buffer in transformers), so that the
checkpoint loader, exporter and sharded init carry it; the optimizer skips it (no gradient).

The aux loss follows transformers too: with ``output_router_logits`` it is the Switch loss of
the *softmax* of the router logits and their own top-k (not the biased sigmoid choice), summed
over all layers (``MoECausalLM.aux_loss``); padding (``segment_ids == 0``) is left out.

Under tensor parallelism each rank holds whole heads, so only a slice of the q/k width: the
width norms (:class:`WidthRMSNorm`) then sum their squares over the TP group (``group``, set by
the family's plan) before normalising, which gives one process's numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.attention import Attention
from meshforge.models.common.causal_lm import DecoderModel, MoECausalLM, build_causal_lm
from meshforge.models.common.moe import GroupedExperts, RouterStats, TopKRouter, expert_counts, router_stats
from meshforge.models.common.norms import RMSNorm
from meshforge.models.common.rope import RotaryEmbedding, apply_partial_rotary
from meshforge.models.minimax_m2.args import MiniMaxM2Args

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class WidthRMSNorm(RMSNorm):
    """RMSNorm over the last two dims ``[heads, head_dim]`` together (the whole projection width).

    ``group`` (None by default) is the tensor-parallel group when each rank holds only some of
    the heads (and the matching slice of ``weight``): the mean square is then taken over the
    full width, summed over the group with a differentiable all-reduce.

    Args:
        dim: The full width ``num_heads * head_dim``.
        eps: Added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.full_dim = dim
        self.group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        if self.group is None or dist.get_world_size(self.group) == 1:
            return super().forward(flat).view_as(x)
        from torch.distributed.nn.functional import all_reduce

        h = flat.float()
        square_sum = all_reduce(h.pow(2).sum(-1, keepdim=True), op=dist.ReduceOp.SUM, group=self.group)
        h = h * torch.rsqrt(square_sum / self.full_dim + self.eps)
        return (self.weight * h.to(x.dtype)).view_as(x)


class MiniMaxM2Attention(Attention):
    """Grouped-query attention with width q/k norms and partial RoPE (``MiniMaxM2Attention``).

    The projections, the kernel switches and the CP / KV-cache seams are those of the common
    :class:`~meshforge.models.common.attention.Attention`; only the norms and the rotation differ.
    """

    q_norm: WidthRMSNorm
    k_norm: WidthRMSNorm

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__(
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
            bias=False,
            qk_norm=False,
            dropout=float(args.attention_dropout),
        )
        self.q_norm = WidthRMSNorm(args.num_attention_heads * args.head_dim, args.rms_norm_eps)
        self.k_norm = WidthRMSNorm(args.num_key_value_heads * args.head_dim, args.rms_norm_eps)
        self.rotary_dim = args.attn_rotary_dim

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | object
    ) -> torch.Tensor:
        """Attend over ``x`` ``[B, S, hidden]`` (mask and CP as in the common attention)."""
        batch, seq_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq_len, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = apply_partial_rotary(q, cos, sin, self.rotary_dim).transpose(1, 2)
        k = apply_partial_rotary(k, cos, sin, self.rotary_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache(k, v)
        out = self._attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class MiniMaxM2Router(TopKRouter):
    """Sigmoid router whose choice is steered by a correction bias (``MiniMaxM2TopKRouter``).

    ``fixed`` (the ``kernels.fix_router`` switch) replaces the choice by the balanced fixed
    one of :class:`TopKRouter`; the weights are still the chosen scores, renormalised.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=True)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` ``[N, hidden]`` with correction ``bias`` ``[E]``.

        Returns:
            ``(logits, weights, indices)``: router logits ``[N, E]``, float32 routing weights
            ``[N, k]`` (summing to one) and expert indices ``[N, k]``.
        """
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        scores = logits.float().sigmoid()
        with torch.no_grad():
            if self.fixed:
                slots = torch.arange(scores.shape[0] * self.top_k, device=scores.device)
                indices = (slots % self.num_experts).view(-1, self.top_k)
            else:
                biased = scores if bias is None else scores + bias.float()
                indices = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        return logits, weights / weights.sum(dim=-1, keepdim=True), indices


class MiniMaxM2SparseMoeBlock(nn.Module):
    """Router ``gate``, fused ``experts`` and the block's ``e_score_correction_bias``.

    After every forward ``last_tokens_per_expert`` holds the assignment counts (all tokens) and,
    when ``record_aux``, ``last_aux_stats`` transformers' aux-loss statistics (softmax of the
    logits and their top-k; padding left out).

    Args:
        args: Structural hyper-parameters.
    """

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = MiniMaxM2Router(args.hidden_size, args.num_local_experts, args.num_experts_per_tok)
        self.experts = GroupedExperts(
            args.num_local_experts, args.hidden_size, args.intermediate_size, args.hidden_act
        )
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_local_experts), requires_grad=False)
        self.record_aux = bool(args.output_router_logits)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_aux_stats: RouterStats | None = None
        # Set by `set_aux_reduce_group` under context parallelism; travels with the stats.
        self.aux_reduce_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the MoE to ``x`` ``[B, S, hidden]``; ``token_mask`` ``[B, S]`` is False on padding."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, indices = self.gate(tokens, self.e_score_correction_bias)
        num_experts = self.gate.num_experts
        with torch.no_grad():
            counts = expert_counts(indices, num_experts)
        self.last_tokens_per_expert = counts
        if self.record_aux:
            probs = torch.softmax(logits.float(), dim=-1)
            with torch.no_grad():
                aux_indices = probs.topk(self.top_k, dim=-1).indices
                aux_counts = expert_counts(aux_indices, num_experts)
            self.last_aux_stats = router_stats(
                probs,
                aux_indices,
                aux_counts,
                token_mask,
                num_experts=num_experts,
                group=self.aux_reduce_group,
            )
        return self.experts(tokens, indices, weights, counts).to(x.dtype).view(shape)


class MiniMaxM2DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + moe(norm(x))``.

    Args:
        args: Structural hyper-parameters.
    """

    is_moe = True

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__()
        self.self_attn = MiniMaxM2Attention(args)
        self.mlp = MiniMaxM2SparseMoeBlock(args)
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
        return x + self.mlp(self.post_attention_layernorm(x), token_mask)


class MiniMaxM2Model(DecoderModel):
    """Embedding, decoder layers and final norm (transformers' ``MiniMaxM2Model``)."""

    pass_token_mask = True

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, args.pad_token_id)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.attn_rotary_dim, args.theta)


class MiniMaxM2ForCausalLM(MoECausalLM[MiniMaxM2Args]):
    """MiniMax-M2 decoder with a language-model head; see the module docstring.

    Args:
        args: Structural hyper-parameters (``MiniMaxM2Args``).
    """

    family = "minimax_m2"
    display_name = "MiniMax-M2"
    init_normal_suffixes = ("_proj.weight", ".experts.gate_up_proj", ".experts.down_proj", ".mlp.gate.weight")
    init_zero_suffixes = (".bias", ".e_score_correction_bias")

    def __init__(self, args: MiniMaxM2Args) -> None:
        super().__init__(args, MiniMaxM2Model(args))

    @property
    def num_routed_experts(self) -> int:
        return self.args.num_local_experts

    def moe_layers(self) -> dict[int, MiniMaxM2SparseMoeBlock]:
        """The sparse blocks by decoder-layer index (every layer)."""
        return {i: cast(MiniMaxM2SparseMoeBlock, layer.mlp) for i, layer in enumerate(self.model.layers)}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token over the active parameters: ``6 * N_active + 12 * L * H * D * S``.

        ``N_active`` counts every matmul weight a token goes through (attention, routers,
        ``num_experts_per_tok`` experts per layer, the LM head, tied or not), not the embedding
        lookup, norms or correction biases.
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
        attention = 12 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * seq_len
        return 6.0 * matmul_params + attention


def build_minimax_m2(args: MiniMaxM2Args, *, device: str | torch.device = "meta") -> MiniMaxM2ForCausalLM:
    """Construct the model on ``device`` (meta by default: no memory, weights come later)."""
    return build_causal_lm(MiniMaxM2ForCausalLM, args, device)


__all__ = [
    "MiniMaxM2Attention",
    "MiniMaxM2DecoderLayer",
    "MiniMaxM2ForCausalLM",
    "MiniMaxM2Model",
    "MiniMaxM2Router",
    "MiniMaxM2SparseMoeBlock",
    "WidthRMSNorm",
    "build_minimax_m2",
]
