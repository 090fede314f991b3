"""DeepSeek-V3 style mixture of experts: sigmoid scores, group-limited top-k, shared experts.

Module and parameter names are those of transformers' ``DeepseekV3MoE`` 5.24:
``gate.weight`` ``[E, hidden]`` (router), ``gate.e_score_correction_bias`` ``[E]``, the fused
``experts.gate_up_proj`` / ``experts.down_proj`` of
:class:`~meshforge.models.common.moe.GroupedExperts`, and ``shared_experts.{gate,up,down}_proj``.

Routing, in float32 as transformers does it (the router weight is read in float32 whatever
the model dtype):

1. ``scores = sigmoid(x @ gate.weight.T)``;
2. selection uses ``scores + e_score_correction_bias`` (DeepSeek's aux-loss-free balancing
   bias: it steers *which* experts are chosen, never the weights);
3. experts are split into ``n_group`` groups, each scored by the sum of its two best
   biased scores; only the ``topk_group`` best groups stay eligible;
4. top-``k`` eligible experts; their weights are the *unbiased* scores, renormalised to sum
   to one when ``norm_topk_prob`` (with transformers' ``1e-20`` guard), then multiplied by
   ``routed_scaling_factor``.

``e_score_correction_bias`` is a frozen parameter (``requires_grad=False``), not a buffer as in
transformers: meshforge's checkpoint loader, exporter and sharded init handle parameters, and
a real DeepSeek-V3 checkpoint's bias must survive loading and export. The optimizer skips it
(no gradient). No load-balancing loss exists for this family in transformers, so the block
records only the assignment counts (``last_tokens_per_expert``).

The routed experts are the common ``GroupedExperts``, so expert parallelism plugs in through
their ``token_exchange`` seam; the shared experts stay dense (every rank runs them on its own
tokens, and FSDP shards them like any other layer weight).

``GroupLimitedSigmoidRouter.fixed`` (the ``kernels.fix_router`` switch, performance tuning
only) replaces steps 2-4's choice by the fixed balanced one of
:class:`~meshforge.models.common.moe.TopKRouter`: token ``i`` takes experts ``(i * k + j) mod E``;
their weights are still the scores, renormalised and scaled as above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.mlp import GatedMLP
from meshforge.models.common.moe import GroupedExperts, RouterStats, expert_counts


class GroupLimitedSigmoidRouter(nn.Module):
    """Sigmoid router with correction bias and group-limited top-k; see the module docstring.

    Args:
        hidden_size: Model width.
        num_experts: Routed experts (``n_routed_experts``).
        top_k: Experts per token (``num_experts_per_tok``).
        num_groups: Expert groups (``n_group``); divides ``num_experts``, at least 2 experts each.
        topk_groups: Groups kept per token (``topk_group``).
        norm_topk_prob: Renormalise the chosen scores to sum to one.
        routed_scaling_factor: Multiplier of the final routing weights.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if num_experts % num_groups or num_experts // num_groups < 2:
            raise ValueError(
                f"n_group: must divide n_routed_experts ({num_experts}) into groups of at least 2, got {num_groups}"
            )
        if not 0 < topk_groups <= num_groups:
            raise ValueError(f"topk_group: must be in [1, n_group={num_groups}], got {topk_groups}")
        if not 0 < top_k <= topk_groups * (num_experts // num_groups):
            raise ValueError(
                f"num_experts_per_tok: must be in [1, {topk_groups * (num_experts // num_groups)}], got {top_k}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        # Set by the `fix_router` kernel switch: fixed balanced assignment (module docstring).
        self.fixed = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` ``[N, hidden]``.

        Returns:
            ``(scores, weights, indices)``: float32 sigmoid scores ``[N, E]``, float32 routing
            weights ``[N, k]`` and expert indices ``[N, k]``.
        """
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        if self.fixed:
            slots = torch.arange(scores.shape[0] * self.top_k, device=scores.device)
            indices = (slots % self.num_experts).view(-1, self.top_k)
        else:
            indices = self._select(scores)
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.routed_scaling_factor, indices

    @torch.no_grad()
    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert indices ``[N, k]``: biased scores, best ``topk_group`` groups, then top-k."""
        # Selection only: no gradient flows through the choice of experts.
        biased = scores + self.e_score_correction_bias.float()
        per_group = self.num_experts // self.num_groups
        group_scores = biased.view(-1, self.num_groups, per_group).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(per_group, dim=1)
        return biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, n_group={self.num_groups}, "
            f"topk_group={self.topk_groups}, norm_topk_prob={self.norm_topk_prob}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )


class SharedExpertMoEBlock(nn.Module):
    """Routed experts plus always-on shared experts (transformers' ``DeepseekV3MoE``).

    After every forward ``last_tokens_per_expert`` holds the assignment counts (LongTensor
    ``[num_experts]``, all tokens, summing to ``tokens * top_k``). It records no router
    statistics (``last_aux_stats`` stays None): transformers computes no aux loss for it.

    Args:
        hidden_size: Model width.
        num_experts: Routed experts.
        top_k: Experts per token.
        intermediate_size: Each routed expert's width (``moe_intermediate_size``).
        num_shared_experts: Shared experts, fused into one MLP of width
            ``intermediate_size * num_shared_experts`` as transformers builds it.
        num_groups: ``n_group``.
        topk_groups: ``topk_group``.
        norm_topk_prob: Renormalise the chosen scores.
        routed_scaling_factor: Multiplier of the routing weights.
        hidden_act: Expert activation.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        num_shared_experts: int,
        num_groups: int = 1,
        topk_groups: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, hidden_act)
        self.gate = GroupLimitedSigmoidRouter(
            hidden_size,
            num_experts,
            top_k,
            num_groups=num_groups,
            topk_groups=topk_groups,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.shared_experts = GatedMLP(hidden_size, intermediate_size * num_shared_experts, hidden_act)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_aux_stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply routed plus shared experts to ``x`` ``[B, S, hidden]``; returns ``[B, S, hidden]``."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        _, weights, indices = self.gate(tokens)
        with torch.no_grad():
            counts = expert_counts(indices, self.gate.num_experts)
        self.last_tokens_per_expert = counts
        routed = self.experts(tokens, indices, weights, counts).to(x.dtype).view(shape)
        return routed + self.shared_experts(x)


__all__ = ["GroupLimitedSigmoidRouter", "SharedExpertMoEBlock"]
