"""Top-k softmax mixture-of-experts block with experts stored fused, as transformers 5.24 keeps them.

Layout (module and parameter names of transformers' ``Qwen3MoeSparseMoeBlock``):

* ``gate.weight`` ``[num_experts, hidden]``: the router, a bias-free linear map;
* ``experts.gate_up_proj`` ``[num_experts, 2 * intermediate, hidden]``: every expert's
  gate rows followed by its up rows (transformers' "concatenated" layout);
* ``experts.down_proj`` ``[num_experts, hidden, intermediate]``.

Safetensors files carry one key per expert and projection instead
(``experts.{e}.gate_proj.weight``); each family's ``hf.py`` maps between the two.

Routing: softmax of the router logits in float32, top-k experts per token,
optionally renormalised over the chosen k (``norm_topk_prob``), weights cast back
to the compute dtype. Expert compute sorts the (token, slot) assignments by expert
and runs one gate/up and one down matmul per expert on its contiguous group of
tokens, then un-sorts and sums the k weighted expert outputs of every token. That
is deterministic (no scatter-add). Forward plus backward of one block, fp32, CPU
time on one thread (robust to other load on the machine), best of 7 (N tokens,
hidden H, expert width I, E experts, top-k):

==============================  =========  ===========  ===========  ========  ==========
shape                           this loop  grouped_mm   padded bmm   HF eager  HF grouped
==============================  =========  ===========  ===========  ========  ==========
N 1024, H 256, I 256, E 8, k 2  29.0 ms    28.3 ms      33.9 ms      29.0 ms   29.2 ms
N 2048, H 512, I 256, E 32, k 4 220 ms     219 ms       271 ms       224 ms    226 ms
==============================  =========  ===========  ===========  ========  ==========

The step is matmul-bound, so every unpadded variant costs the same; padding the
groups to the largest one for ``torch.bmm`` wastes 17-23 %.

``GroupedExperts.use_grouped_mm`` (off by default; for the ``moe_grouped_gemm``
kernel switch) runs each projection as one ``torch.nn.functional.grouped_mm`` with
expert offsets instead, the grouped-GEMM kernel on CUDA (bf16 there, per torch's
documentation). On CPU in torch 2.13 it gives the same numbers at the same cost,
and its backward rejects a gradient with zero strides (an expanded ``sum()``
gradient straight into the op).

Compiled (``kernels.compile``), a MoE layer stays one graph: the counts per expert come from
a fixed-size scatter-add (:func:`expert_counts`, not ``bincount``, whose output size depends on
the data), and the per-expert loop splits on unbacked sizes (:func:`group_sizes`), which needs
``torch._dynamo.config.capture_scalar_outputs = True`` where layers are compiled. torch 2.13
traces ``grouped_mm`` only in bfloat16, so a compiled float32 layer runs the loop
(:func:`traceable_grouped_mm`); both give the eager numbers bitwise.

Expert parallelism plugs in at one seam: ``token_exchange`` on the experts module
(None by default). ``meshforge.parallel.expert.apply_ep`` sets it to an all-to-all
exchange that sends the expert-sorted token copies to the ranks owning their experts,
runs the local experts there, and brings the outputs back before the same un-sort and
mix; routing, aux-loss statistics and counts stay as computed from the rank's own tokens.

Each forward leaves behind what the trainer and monitor need, a few
``[num_experts]`` vectors per layer: ``last_tokens_per_expert`` (assignment counts,
a LongTensor) and ``last_aux_stats``, the per-layer sums (the probability sum keeps
the router's autograd graph until backward) from which
:func:`load_balancing_loss` forms the Switch-Transformer aux loss over all MoE
layers exactly as transformers' ``load_balancing_loss_func`` does.

Context parallelism splits every sequence over the CP ranks, so one rank's sums cover only
its part of the rows. :func:`set_aux_reduce_group` gives the blocks the CP group; their
``RouterStats`` then carry it and :func:`load_balancing_loss` sums the totals over that
group before the product (:func:`reduce_router_totals`). Why that gives exactly one
process's gradient: every CP rank ends with the same loss value ``L``; the trainer weights
rank r's copy by ``w_r`` (its valid tokens over the global count), the ``w_r`` summing to the
micro-batch's share ``w``. The backward of the summing all-reduce sums the incoming
gradients ``w_r * dL/dP`` over the ranks, so every rank's local probability sums get
``w * dL/dP``, the gradient one process gives the whole micro-batch. The assignment counts
and row counts carry no gradient and are summed with a plain all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from meshforge.models.common.mlp import activation
from meshforge.utils.distributed import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class RouterStats:
    """One MoE layer's contribution to the load-balancing loss of one forward.

    Attributes:
        assignments: float32 ``[num_experts]``: how many (non-padding) top-k slots
            chose each expert; no gradient.
        prob_sum: float32 ``[num_experts]``: sum over (non-padding) tokens of the
            router probabilities; carries the router's gradient.
        rows: Number of tokens counted (float32 scalar tensor).
        group: Process group the rows of this forward are split over (context
            parallelism), whose totals the loss needs; None when all rows are here.
    """

    assignments: torch.Tensor
    prob_sum: torch.Tensor
    rows: torch.Tensor
    group: ProcessGroup | None = None


def set_aux_reduce_group(model: torch.nn.Module, group: ProcessGroup | DeviceMesh | None) -> int:
    """Make the router aux loss of ``model`` sum its statistics over ``group`` (the CP group).

    Call it after ``apply_cp`` with the context-parallel group (or mesh): every rank of it
    holds part of each sequence. Sets ``aux_reduce_group`` on every block that records
    ``last_aux_stats`` and on ``model`` itself (the pipeline's last stage reads it there).

    Args:
        model: The causal LM (any family; blocks without aux statistics are left alone).
        group: A ``ProcessGroup``, a 1-D ``DeviceMesh``, or None to undo.

    Returns:
        The number of MoE blocks that now reduce over ``group``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    process_group = group.get_group() if isinstance(group, DeviceMesh) else group
    count = 0
    # setattr: torch types nn.Module.__setattr__'s value Tensor | Module; a group is a plain attribute.
    for module in model.modules():
        if hasattr(module, "last_aux_stats"):
            setattr(module, "aux_reduce_group", process_group)  # noqa: B010
            count += 1
    setattr(model, "aux_reduce_group", process_group)  # noqa: B010
    return count


def reduce_router_totals(
    assignments: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum the aux-loss totals over ``group``: ``prob_sum`` differentiably, the counts plainly.

    The backward of the differentiable all-reduce sums the ranks' incoming gradients (see the
    module docstring for why that is exactly one process's gradient). A no-op without a group
    or on a 1-rank group.
    """
    if group is None or dist.get_world_size(group) == 1:
        return assignments, prob_sum, rows
    from torch.distributed.nn.functional import all_reduce

    prob_sum = all_reduce(prob_sum, op=dist.ReduceOp.SUM, group=group)
    counts = torch.cat([assignments.detach().float(), rows.detach().float().reshape(1)])
    dist.all_reduce(counts, group=group)
    return counts[:-1], prob_sum, counts[-1]


def switch_loss(
    assignments: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """``num_experts * sum_e (assignments_e / rows) * (prob_sum_e / rows)``, from summed totals."""
    return num_experts * torch.sum((assignments / rows) * (prob_sum / rows))


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor | None:
    """Switch-Transformer load-balancing loss over several MoE layers, unscaled.

    Same arithmetic as transformers' ``load_balancing_loss_func``: assignments and
    probabilities are summed over all layers first and divided by the total number
    of rows, then ``num_experts * sum_e f_e * P_e``, where ``f_e`` is the fraction of
    top-k slots routed to expert e (summing to k) and ``P_e`` its mean router
    probability. Padding tokens were left out of the sums by the layers. When the
    statistics carry a group (context parallelism), the totals are first summed over it,
    so every rank of the group gets the loss of the whole sequences.

    Args:
        stats: One entry per MoE layer of the forward.
        num_experts: Number of routed experts.

    Returns:
        A float32 scalar, or None when ``stats`` is empty (no MoE layer ran).
    """
    if not stats:
        return None
    assignments = torch.stack([s.assignments for s in stats]).sum(0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
    rows = torch.stack([s.rows for s in stats]).sum()
    assignments, prob_sum, rows = reduce_router_totals(assignments, prob_sum, rows, stats[0].group)
    return switch_loss(assignments, prob_sum, rows, num_experts)


class TopKRouter(nn.Module):
    """Bias-free linear router with softmax top-k selection (transformers' ``Qwen3MoeTopKRouter``).

    Args:
        hidden_size: Model width.
        num_experts: Routed experts.
        top_k: Experts per token.
        norm_topk_prob: Renormalise the k chosen probabilities to sum to 1.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: must be in [1, num_experts={num_experts}], got {top_k}")
        self.top_k = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # Set by the `fix_router` kernel switch: fixed balanced assignment (see `forward`).
        self.fixed = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens ``x`` ``[N, hidden]``.

        Returns:
            ``(probs, weights, indices)``: float32 softmax probabilities ``[N, E]``,
            routing weights ``[N, k]`` in ``x``'s dtype and expert indices ``[N, k]``.
        """
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.fixed:
            # Performance tuning only: token i takes experts (i*k + j) mod E, j < k, so every
            # expert gets the same number of slots (+-1); weights are those experts' probabilities.
            slots = torch.arange(probs.shape[0] * self.top_k, device=probs.device)
            indices = (slots % self.num_experts).view(-1, self.top_k)
            weights = probs.gather(1, indices)
        else:
            weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(logits.dtype), indices

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
"""``(tokens sorted by expert, counts per expert) -> expert outputs`` (None for zero rows)."""


class TokenExchange(Protocol):
    """How expert-sorted token copies reach the experts that own them (the EP seam).

    Called with the rank's token copies sorted by expert, the rank's counts per (global)
    expert and the experts module's compute on *local* experts; returns the expert outputs
    for the same rows in the same order (a tensor, also for zero rows, so that every rank
    takes part in the backward collectives).
    """

    def __call__(
        self, grouped: torch.Tensor, counts: torch.Tensor, compute: ExpertCompute
    ) -> torch.Tensor: ...


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, LongTensor ``[num_experts]``, from the chosen experts ``[N, k]``.

    ``bincount`` would give the same counts, but its output size depends on the data (the
    largest index), which breaks a compiled graph; a scatter-add into ``num_experts`` slots
    has a static shape, and integer sums do not depend on the order of the adds.
    """
    flat = indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def dispatch_to_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    compute: Callable[[torch.Tensor], torch.Tensor | None],
) -> torch.Tensor:
    """Sort token copies by expert, run ``compute`` on them, and mix the results back.

    Args:
        x: Tokens ``[N, hidden]``.
        indices: Chosen experts ``[N, k]``.
        weights: Their routing weights ``[N, k]``.
        compute: Expert outputs for the token copies sorted by expert (each expert's rows
            contiguous, in expert order), or None when there are no rows.

    Returns:
        ``sum_j weights[:, j] * expert_{indices[:, j]}(x)``, shape ``[N, hidden]``.
    """
    num_tokens, top_k = indices.shape
    # A stable sort keeps each expert's tokens in token order, so results do not depend on
    # the sort implementation.
    order = torch.argsort(indices.reshape(-1), stable=True)
    sorted_out = compute(x.index_select(0, order // top_k))
    if sorted_out is None:  # zero tokens
        return torch.zeros_like(x)
    # Un-sort: row i of `per_slot` is the expert output for (token i // k, slot i % k).
    per_slot = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    # Explicit sizes: with zero tokens the result stays an (empty) part of the graph, which
    # expert parallelism needs (the rank still joins the backward all-to-alls).
    per_slot = per_slot.view(num_tokens, top_k, sorted_out.shape[-1]) * weights.unsqueeze(-1)
    return per_slot.sum(dim=1)


def group_sizes(grouped: torch.Tensor, counts: torch.Tensor) -> list[int]:
    """The rows of each expert in ``grouped`` as Python ints, for ``torch.split``.

    Eager, this is one host sync. Under ``torch.compile`` (with
    ``torch._dynamo.config.capture_scalar_outputs``) the sizes are unbacked symbols; the
    checks tell the compiler they are sizes that add up to the rows, so the per-expert loop
    stays in the layer's graph instead of breaking it.
    """
    sizes = host_ints(counts, lambda: even_split(grouped.shape[0], counts.numel()))
    if torch.compiler.is_compiling():
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == grouped.shape[0])
    return sizes


def host_ints(values: torch.Tensor, balanced: Callable[[], list[int]]) -> list[int]:
    """``values.tolist()``: the one host sync of a routing step.

    On fake tensors (``meshforge config validate --dry-run``) there are no values: routing is
    taken as balanced, ``balanced()``, which is also the load a router's balancing loss aims for.
    """
    if not torch.compiler.is_compiling() and is_fake(values):
        return balanced()
    return [int(v) for v in values.tolist()]


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` as evenly as integers allow (the first ones get the remainder)."""
    base, extra = divmod(int(total), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def skip_empty(group: torch.Tensor) -> bool:
    """Whether the per-expert loop may skip ``group`` (no rows).

    Only eagerly: compiled, the size is a data-dependent symbol that cannot be branched on,
    and an empty matmul costs nothing and changes no number.
    """
    return not torch.compiler.is_compiling() and group.shape[0] == 0


def traceable_grouped_mm(grouped: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` can run on ``grouped`` here.

    Compiled, torch 2.13's shape function of ``grouped_mm`` accepts only bfloat16 (the CUDA
    kernel's dtype), so a compiled float32 layer runs the per-expert loop instead: the same
    numbers (see the module docstring).
    """
    return grouped.dtype == torch.bfloat16 or not torch.compiler.is_compiling()


def run_experts(experts: ExpertsBase, counts: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The ``compute`` argument of :func:`dispatch_to_experts` for an experts module.

    ``experts`` has ``compute(grouped, counts)`` and ``token_exchange``; without an exchange
    its experts run right here on the sorted copies, with one they run where they live.
    """
    exchange = experts.token_exchange
    if exchange is None:
        return lambda grouped: experts.compute(grouped, counts)
    return lambda grouped: exchange(grouped, counts, experts.compute)


class ExpertsBase(nn.Module):
    """What every fused experts module shares: the dispatch of routed tokens and the seams.

    A subclass holds its expert weights and implements ``_loop`` and ``_grouped_mm`` (the
    outputs for tokens sorted by expert); ``use_grouped_mm`` (the ``moe_grouped_gemm`` switch)
    picks one, and ``token_exchange`` (set by expert parallelism) sends the sorted tokens to
    the ranks that hold their experts.
    """

    use_grouped_mm: bool
    token_exchange: TokenExchange | None
    # The fused expert weights, experts on dim 0 (each subclass creates both).
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Mix the top-k experts of every token.

        Args:
            x: Tokens ``[N, hidden]``.
            indices: Chosen experts ``[N, k]``.
            weights: Their routing weights ``[N, k]``.
            counts: Assignments per expert ``[num_experts]`` (:func:`expert_counts` of ``indices``).

        Returns:
            ``sum_j weights[:, j] * expert_{indices[:, j]}(x)``, shape ``[N, hidden]``.
        """
        return dispatch_to_experts(x, indices, weights, run_experts(self, counts))

    def compute(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Outputs of the experts held here for tokens sorted by (local) expert, ``counts`` per expert."""
        if self.use_grouped_mm and traceable_grouped_mm(grouped):
            return self._grouped_mm(grouped, counts)
        return self._loop(grouped, counts)

    def _loop(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError


class GroupedExperts(ExpertsBase):
    """``num_experts`` SwiGLU experts in two fused 3-D parameters (transformers' ``Qwen3MoeExperts``).

    Args:
        num_experts: Number of experts.
        hidden_size: Model width.
        intermediate_size: Each expert's hidden width (``moe_intermediate_size``).
        hidden_act: Activation name (``silu``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = activation(hidden_act)
        # Set by the ``moe_grouped_gemm`` kernel switch: one ``F.grouped_mm`` per projection
        # instead of the per-expert loop (same numbers; see the module docstring).
        self.use_grouped_mm = False
        # Set by expert parallelism (`meshforge.parallel.expert.apply_ep`); None = all experts here.
        self.token_exchange: TokenExchange | None = None

    def _loop(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Expert outputs for tokens sorted by expert: two matmuls per expert with tokens."""
        # One host sync per layer to know the group sizes; the matmuls need them anyway.
        sizes = group_sizes(grouped, counts)
        # unbind once rather than indexing per expert: the backward of each `param[e]`
        # would allocate and zero-fill a full-size gradient (measured: a fifth of the step).
        gate_up, down = local_tensor(self.gate_up_proj).unbind(0), local_tensor(self.down_proj).unbind(0)
        outputs = []
        for expert, group in enumerate(torch.split(grouped, sizes)):
            if skip_empty(group):
                continue
            gate, up = F.linear(group, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        if not outputs:
            # No rows: run expert 0 on the empty input anyway, so that the weights get a (zero)
            # gradient. Under expert parallelism a rank whose experts received no token must still
            # reduce-scatter their gradients with the ranks that hold the same experts.
            gate, up = F.linear(grouped, gate_up[0]).chunk(2, dim=-1)
            return F.linear(self.act_fn(gate) * up, down[0])
        return torch.cat(outputs)

    def _grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Same as :meth:`_loop` with one grouped GEMM per projection and no host sync."""
        if grouped.shape[0] == 0:
            return self._loop(grouped, counts)  # an empty output that still reaches the weights
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up, down = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate, up = F.grouped_mm(grouped, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(self.act_fn(gate) * up, down.transpose(1, 2), offs=offsets)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}"


class MoEBlock(nn.Module):
    """Sparse MoE feed-forward: router ``gate`` plus fused ``experts``.

    After every forward, ``last_tokens_per_expert`` holds the assignment counts
    (LongTensor ``[num_experts]``, all tokens including padding, so it sums to
    ``tokens * top_k``) and ``last_aux_stats`` this layer's :class:`RouterStats`
    (padding excluded when a token mask was given).

    Args:
        hidden_size: Model width.
        num_experts: Routed experts.
        top_k: Experts per token (``num_experts_per_tok``).
        intermediate_size: Expert hidden width (``moe_intermediate_size``).
        norm_topk_prob: Renormalise the chosen probabilities.
        hidden_act: Expert activation.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        norm_topk_prob: bool,
        hidden_act: str = "silu",
    ) -> None:
        super().__init__()
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, hidden_act)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob=norm_topk_prob)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_aux_stats: RouterStats | None = None
        # Set by `set_aux_reduce_group` under context parallelism; travels with the stats.
        self.aux_reduce_group: ProcessGroup | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the MoE to ``x`` ``[B, S, hidden]``.

        Args:
            x: Normalised hidden states.
            token_mask: Optional boolean ``[B, S]``, False for padding tokens, which are
                then left out of the aux-loss statistics (they are still computed).

        Returns:
            ``[B, S, hidden]``.
        """
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, weights, indices = self.gate(tokens)
        num_experts = self.gate.num_experts
        with torch.no_grad():
            counts = expert_counts(indices, num_experts)
        self.last_tokens_per_expert = counts
        self._record_aux_stats(probs, indices, counts, token_mask)
        return self.experts(tokens, indices, weights, counts).view(shape)

    def _record_aux_stats(
        self,
        probs: torch.Tensor,
        indices: torch.Tensor,
        counts: torch.Tensor,
        token_mask: torch.Tensor | None,
    ) -> None:
        self.last_aux_stats = router_stats(
            probs, indices, counts, token_mask, num_experts=self.gate.num_experts, group=self.aux_reduce_group
        )


def router_stats(
    probs: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    token_mask: torch.Tensor | None,
    *,
    num_experts: int,
    group: ProcessGroup | None,
) -> RouterStats:
    """One layer's router statistics for the aux loss, padding left out.

    Args:
        probs: Router probabilities over all experts ``[N, E]`` (float32, with autograd).
        indices: The top-k experts of each token ``[N, k]``.
        counts: Assignments per expert over all tokens ``[E]`` (used as they are without a mask).
        token_mask: ``[B, S]`` False for padding, or None.
        num_experts: ``E``.
        group: The process group the statistics are summed over (CP), or None.
    """
    if token_mask is None:
        assignments = counts.float()
        prob_sum = probs.sum(0)
        rows = torch.tensor(float(probs.shape[0]), device=probs.device)
    else:
        keep = token_mask.reshape(-1).to(torch.float32)
        with torch.no_grad():
            assignments = torch.zeros(num_experts, device=probs.device).index_add_(
                0, indices.reshape(-1), keep.repeat_interleave(indices.shape[-1])
            )
        prob_sum = (probs * keep[:, None]).sum(0)
        rows = keep.sum()
    return RouterStats(assignments=assignments, prob_sum=prob_sum, rows=rows, group=group)


__all__ = [
    "ExpertCompute",
    "expert_counts",
    "group_sizes",
    "host_ints",
    "even_split",
    "skip_empty",
    "traceable_grouped_mm",
    "GroupedExperts",
    "MoEBlock",
    "RouterStats",
    "TokenExchange",
    "TopKRouter",
    "dispatch_to_experts",
    "load_balancing_loss",
    "local_tensor",
    "ExpertsBase",
    "reduce_router_totals",
    "router_stats",
    "run_experts",
    "set_aux_reduce_group",
    "switch_loss",
]
