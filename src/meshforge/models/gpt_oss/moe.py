"""gpt-oss' mixture of experts: a biased top-k router and clamped-SwiGLU experts with biases.

Differences from the Qwen3-MoE block in ``common/moe.py``, all as transformers 5.24
keeps them (``GptOssTopKRouter``, ``GptOssExperts``, ``GptOssMLP``):

* the router has a bias and picks the top-k *logits*, then takes the softmax over
  those k only (the weights always sum to 1); the aux loss still uses the softmax
  over all experts;
* expert weights are stored transposed, ``x @ W``: ``gate_up_proj`` ``[E, hidden, 2I]``
  and ``down_proj`` ``[E, I, hidden]``, each with a bias (``gate_up_proj_bias``
  ``[E, 2I]``, ``down_proj_bias`` ``[E, hidden]``);
* gate and up are *interleaved* along the last dimension (gate = columns 0, 2, 4, ...,
  up = 1, 3, 5, ...), not concatenated;
* the activation is ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
  ``g = clamp(gate, max=limit)``.

The module names are transformers' (``mlp.router``, ``mlp.experts``). Expert compute
sorts the (token, slot) assignments by expert and runs each expert once on its
contiguous group, like ``common.moe.GroupedExperts`` (deterministic, no scatter-add).
After a forward, ``last_tokens_per_expert`` and ``last_aux_stats`` hold what the
trainer and monitor read. Expert parallelism uses the same ``token_exchange`` seam as the
common experts (see ``common/moe.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.moe import (
    ExpertsBase,
    RouterStats,
    TokenExchange,
    expert_counts,
    group_sizes,
    local_tensor,
    router_stats,
    skip_empty,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GptOssTopKRouter(nn.Module):
    """Linear router with bias: top-k of the logits, softmax over the chosen k.

    Args:
        hidden_size: Model width.
        num_experts: Routed experts.
        top_k: Experts per token.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_local_experts={num_experts}], got {top_k}"
            )
        self.top_k = top_k
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))
        # Set by the `fix_router` kernel switch: fixed balanced assignment (see `forward`).
        self.fixed = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` ``[N, hidden]``.

        Returns:
            ``(logits, weights, indices)``: router logits ``[N, E]``, routing weights
            ``[N, k]`` (softmax over the top-k logits) and expert indices ``[N, k]``.
        """
        logits = F.linear(x, self.weight, self.bias)
        if self.fixed:
            # Performance tuning only: token i takes experts (i*k + j) mod E, j < k, so every
            # expert gets the same number of slots (+-1); weights: softmax over those k logits.
            slots = torch.arange(logits.shape[0] * self.top_k, device=logits.device)
            indices = (slots % self.num_experts).view(-1, self.top_k)
            top = logits.gather(1, indices)
        else:
            top, indices = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(top, dim=1, dtype=top.dtype)
        return logits, weights, indices

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}"


class GptOssExperts(ExpertsBase):
    """``num_experts`` clamped-SwiGLU experts with biases, fused and transposed as transformers keeps them.

    Args:
        num_experts: Number of experts.
        hidden_size: Model width.
        intermediate_size: Each expert's hidden width.
        alpha: Sigmoid gain of the gate (``swiglu_alpha``).
        limit: Clamp of gate (above) and up (both sides) (``swiglu_limit``).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float, limit: float
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        # Set by the `moe_grouped_gemm` kernel switch: one `F.grouped_mm` per projection
        # instead of the per-expert loop (same numbers).
        self.use_grouped_mm = False
        # Set by expert parallelism (`meshforge.parallel.expert.apply_ep`); None = all experts here.
        self.token_exchange: TokenExchange | None = None

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved ``[..., 2I]`` gate/up columns, ``[..., I]``."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _loop(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Expert outputs for tokens sorted by expert: two matmuls per expert with tokens."""
        # unbind once: indexing `param[e]` per expert would allocate a full-size gradient each time.
        w1, b1 = local_tensor(self.gate_up_proj).unbind(0), local_tensor(self.gate_up_proj_bias).unbind(0)
        w2, b2 = local_tensor(self.down_proj).unbind(0), local_tensor(self.down_proj_bias).unbind(0)
        outputs = []
        for expert, group in enumerate(torch.split(grouped, group_sizes(grouped, counts))):
            if skip_empty(group):
                continue
            hidden = self.activation(group @ w1[expert] + b1[expert])
            outputs.append(hidden @ w2[expert] + b2[expert])
        if not outputs:
            # No rows: run expert 0 on the empty input anyway so that the weights get a (zero)
            # gradient (expert parallelism: see `GroupedExperts._loop`).
            return self.activation(grouped @ w1[0] + b1[0]) @ w2[0] + b2[0]
        return torch.cat(outputs)

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Same as :meth:`_loop` with one grouped GEMM per projection (weights are already ``x @ W``)."""
        if grouped.shape[0] == 0:
            return self._loop(grouped, counts)  # an empty output that still reaches the weights
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        w1, b1 = local_tensor(self.gate_up_proj), local_tensor(self.gate_up_proj_bias)
        w2, b2 = local_tensor(self.down_proj), local_tensor(self.down_proj_bias)
        # Row r belongs to expert expert_of_row[r]; its bias row is gathered once per projection.
        # counts covers the experts held here (all of them, or this rank's under EP).
        expert_of_row = torch.repeat_interleave(
            torch.arange(counts.numel(), device=counts.device), counts, output_size=grouped.shape[0]
        )
        hidden = self.activation(F.grouped_mm(grouped, w1, offs=offsets) + b1.index_select(0, expert_of_row))
        return F.grouped_mm(hidden, w2, offs=offsets) + b2.index_select(0, expert_of_row)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, "
            f"alpha={self.alpha}, limit={self.limit}"
        )


class GptOssMLP(nn.Module):
    """Sparse MoE feed-forward: ``router`` plus ``experts`` (transformers' ``GptOssMLP``).

    After every forward, ``last_tokens_per_expert`` holds the assignment counts
    (LongTensor ``[num_experts]``, all tokens including padding, summing to
    ``tokens * top_k``) and ``last_aux_stats`` this layer's :class:`RouterStats`
    (softmax over all experts; padding excluded when a token mask was given).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.router = GptOssTopKRouter(hidden_size, num_experts, top_k)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, alpha=alpha, limit=limit)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_aux_stats: RouterStats | None = None
        # Set by `common.moe.set_aux_reduce_group` under context parallelism.
        self.aux_reduce_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the MoE to ``x`` ``[B, S, hidden]``; ``token_mask`` ``[B, S]`` is False for padding."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, indices = self.router(tokens)
        with torch.no_grad():
            counts = expert_counts(indices, self.router.num_experts)
        self.last_tokens_per_expert = counts
        self._record_aux_stats(logits, indices, counts, token_mask)
        return self.experts(tokens, indices, weights, counts).view(shape)

    def _record_aux_stats(
        self,
        logits: torch.Tensor,
        indices: torch.Tensor,
        counts: torch.Tensor,
        token_mask: torch.Tensor | None,
    ) -> None:
        # transformers' load_balancing_loss_func takes the softmax over *all* router logits
        # (bias included); its top-k of those probabilities picks the same experts as the router.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        self.last_aux_stats = router_stats(
            probs,
            indices,
            counts,
            token_mask,
            num_experts=self.router.num_experts,
            group=self.aux_reduce_group,
        )


__all__ = ["GptOssExperts", "GptOssMLP", "GptOssTopKRouter"]
