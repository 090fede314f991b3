"""Expert parallelism (EP): each rank of the ``ep`` mesh holds ``num_experts / ep`` experts.

`apply_ep` runs on the meta model, before FSDP and materialisation (issue 5's order: PP -> TP ->
EP -> CP -> compile -> FSDP). It does two things to every MoE experts module (the common
``GroupedExperts`` of qwen3_moe, qwen3_next and deepseek_v3, and gpt_oss' ``GptOssExperts``):

* its fused expert parameters (all ``[num_experts, ...]``) become DTensors ``Shard(0)`` on the
  ep mesh, so materialisation and HF loading (``distribute_tensor(full, mesh, placements)``)
  give each rank its contiguous block of experts ``ep_rank * n_local ... + n_local - 1``;
* its ``token_exchange`` seam gets an :class:`AllToAllExchange`, MindSpeed's eager
  ``alltoall`` dispatcher on PyTorch collectives.

Dispatch, per MoE layer and forward (routing is untouched: every rank routes its own tokens
with the full router, so the aux-loss statistics and tokens-per-expert counts are exactly what
they are without EP):

1. the block sorts its ``N * k`` token copies by expert (``dispatch_to_experts``);
2. the per-expert counts go to every rank with one ``all_to_all_single`` (even splits of
   ``n_local`` counts), so each rank learns how many rows it receives from whom;
3. the rows travel with ``all_to_all_single_autograd`` (uneven splits; gloo supports those, not
   the list form), whose backward sends every row's gradient back to its sender;
4. the receiver regroups them by local expert (source-rank order inside an expert) and runs its
   local experts, the same compute as without EP;
5. the outputs return by the reverse all-to-all, and the block un-sorts and mixes them with the
   routing weights as before.

Gradient scaling: the trainer divides the loss sum by the global valid-token count and FSDP
sums (divide factor 1). The backward of step 3 brings every token's contribution to the
expert's owner, and expert-FSDP (``apply_fsdp(expert_mesh=...)``) sums over the ranks that own
the same experts, so expert gradients need no 1/ep factor (MindSpeed's 1/ep backward hook
compensates for its averaging loss, which we do not have). ``tests/distributed/test_ep.py``
checks this against one process.

``moe_token_dispatcher_type: alltoall_deredundancy`` (MindFormers, Ascend) sends a token that
picked several experts on the same node across the node boundary once and copies it inside the
node; it is not built here (refused): the eager exchange sends one copy per (token, expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshforge.models.common.moe import ExpertCompute, GroupedExperts
from meshforge.models.gpt_oss.moe import GptOssExperts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EXPERT_MODULES: tuple[type[nn.Module], ...] = (GroupedExperts, GptOssExperts)
"""Experts containers that have the ``token_exchange`` seam and ``[num_experts, ...]`` weights."""

# The model key that holds each family's routed-expert count (for error messages).
_EXPERT_COUNT_KEYS = {
    "qwen3_moe": "model.num_experts",
    "deepseek_v3": "model.n_routed_experts",
    "gpt_oss": "model.num_local_experts",
    "qwen3_next": "model.num_experts",
}

TOKEN_DISPATCHERS = ("alltoall",)
EP_DISPATCHERS = ("eager",)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every MoE experts container in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EXPERT_MODULES)]


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is an experts container whose weights are sharded over an ep mesh."""
    return isinstance(module, EXPERT_MODULES) and isinstance(module.token_exchange, AllToAllExchange)


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    token_dispatcher: str = "alltoall",
    dispatcher: str = "eager",
) -> None:
    """Shard every MoE block's experts over ``ep_mesh`` and route tokens to them by all-to-all.

    Call on the (meta or real) model before FSDP; real weights are sliced locally (every rank
    holds the same full tensor), meta ones just get DTensor metadata.

    Args:
        model: A built-in MoE family model (qwen3_moe, qwen3_next, deepseek_v3, gpt_oss).
        ep_mesh: 1-D mesh of the ranks that share one copy of the experts.
        token_dispatcher: ``parallelism.moe_token_dispatcher_type``; only ``alltoall``.
        dispatcher: ``parallelism.ep_dispatcher``; only ``eager``.

    Raises:
        ValueError: the mesh is not 1-D, the model has no MoE experts, or the expert count is
            not divisible by the ep degree (naming ``parallelism.expert_parallel`` and the
            model key).
        NotImplementedError: another dispatcher, or a model family without the EP seam.
    """
    if token_dispatcher not in TOKEN_DISPATCHERS:
        raise NotImplementedError(
            f"not supported yet: parallelism.moe_token_dispatcher_type={token_dispatcher!r} (node-level "
            f"de-duplication of token copies); supported: {', '.join(TOKEN_DISPATCHERS)}"
        )
    if dispatcher not in EP_DISPATCHERS:
        raise NotImplementedError(
            f"not supported yet: parallelism.ep_dispatcher={dispatcher!r}; supported: {', '.join(EP_DISPATCHERS)}"
        )
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep: the ep mesh must be 1-D, got {ep_mesh.ndim}-D {ep_mesh}")
    family = str(getattr(model, "family", type(model).__name__))
    experts = expert_modules(model)
    if not experts:
        if not type(model).__module__.startswith("meshforge."):
            raise NotImplementedError(
                f"not supported yet: parallelism.expert_parallel > 1 for transformers models (the generic "
                f"path; {type(model).__name__}); built-in MoE families: {', '.join(sorted(_EXPERT_COUNT_KEYS))}"
            )
        if callable(getattr(model, "moe_layers", None)):  # a MoE family without the token_exchange seam
            raise NotImplementedError(f"not supported yet: parallelism.expert_parallel > 1 for {family}")
        raise ValueError(
            f"parallelism.expert_parallel: {ep_mesh.size()} needs a mixture-of-experts model, but "
            f"{family} has no routed experts; set it to 1"
        )
    ep = ep_mesh.size()
    exchange = AllToAllExchange(ep_mesh)
    for name, module in experts:  # check them all before changing any
        num_experts = int(module.num_experts)
        if num_experts % ep:
            key = _EXPERT_COUNT_KEYS.get(family, "model.num_experts")
            raise ValueError(
                f"parallelism.expert_parallel: {ep} does not divide {key} = {num_experts} "
                f"(each rank holds num_experts / expert_parallel experts of {name})"
            )
    for _, module in experts:
        _shard_experts(module, ep_mesh)
        module.token_exchange = exchange


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace each ``[num_experts, ...]`` parameter by a ``Shard(0)`` DTensor on ``ep_mesh``."""
    for pname, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(
                f"apply_ep: {pname} of {type(module).__name__} is already distributed ({param.placements}); "
                "apply EP before FSDP and on experts that tensor parallelism left alone"
            )
        # src_data_rank=None: every rank already holds the same full tensor (or meta), so each
        # keeps its slice without communication.
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))


class AllToAllExchange:
    """The eager all-to-all token exchange over one ep group (a ``TokenExchange``).

    One instance serves every MoE layer of the model: it holds only the group.

    Args:
        ep_mesh: 1-D mesh; rank ``r`` of it holds experts ``[r * n_local, (r + 1) * n_local)``.
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    @torch.compiler.disable  # host syncs and collectives with data-dependent splits
    def __call__(self, grouped: torch.Tensor, counts: torch.Tensor, compute: ExpertCompute) -> torch.Tensor:
        """Expert outputs for ``grouped`` (rows sorted by global expert, ``counts[e]`` rows each).

        Args:
            grouped: ``[sum(counts), hidden]`` token copies of this rank, sorted by expert.
            counts: int64 ``[num_experts]`` rows per global expert.
            compute: The experts module's compute on its local experts.

        Returns:
            ``[sum(counts), hidden]`` outputs, row for row.
        """
        ep = self.size
        n_local = counts.numel() // ep
        with torch.no_grad():
            send_counts = counts.to(torch.int64).contiguous()
            recv_counts = torch.empty_like(send_counts)
            # recv_counts[s * n_local + j]: rows rank s sends to my local expert j.
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            # One host sync for both directions (the splits must be Python ints).
            send_matrix = send_counts.view(ep, n_local)
            recv_matrix = recv_counts.view(ep, n_local)
            both = torch.cat([send_matrix.sum(1), recv_matrix.sum(1)]).tolist()
            send_splits, recv_splits = both[:ep], both[ep:]
            # Received rows come source by source, each source's rows by local expert; the local
            # experts want them expert by expert: a stable sort by (expert, source) regroups them.
            chunk = torch.arange(ep * n_local, device=counts.device)
            chunk_of_row = torch.repeat_interleave(chunk, recv_counts.to(chunk.device))
            key = (chunk_of_row % n_local) * ep + chunk_of_row // n_local
            regroup = torch.argsort(key, stable=True)
            local_counts = recv_matrix.sum(0)
        received = all_to_all_single_autograd(grouped, recv_splits, send_splits, self.group)
        local_in = received.index_select(0, regroup)
        out = compute(local_in, local_counts)
        if out is None:
            # No rows arrived: send back the (empty) input so the graph still holds both
            # all-to-alls and this rank joins their backward.
            out = local_in
        back = torch.empty_like(out).index_copy_(0, regroup, out)
        result = all_to_all_single_autograd(back, send_splits, recv_splits, self.group)
        return _wait(result)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a functional collective's (possibly asynchronous) result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


__all__ = [
    "EXPERT_MODULES",
    "AllToAllExchange",
    "apply_ep",
    "expert_modules",
    "is_expert_parallel",
]
