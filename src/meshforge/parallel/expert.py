"""Expert parallelism (EP): each rank of the ``ep`` mesh holds ``num_experts / ep`` experts.

`apply_ep` runs on the meta model, before FSDP and materialisation (DESIGN.md's order: PP -> TP ->
EP -> CP -> compile -> FSDP). It does two things to every MoE experts module (the type each MoE family's spec names: the
common ``GroupedExperts`` of qwen3_moe, qwen3_next and deepseek_v3, gpt_oss' ``GptOssExperts``):

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

``moe_token_dispatcher_type: alltoall_deredundancy`` (MindFormers) removes the redundant
copies: with ``alltoall`` a token routed to k experts travels k times even when several of them
live on one rank. :class:`DeduplicatedExchange` sends each token once per destination rank,
together with its local experts there and their routing weights; the destination runs those
experts, weights and sums the token's outputs itself, and returns one combined row per
(token, rank). The routing weights travel in the same all-to-all as the hidden states (one
extra ``k`` columns), so their gradient comes back through it and the router still learns.
That needs the tokens, indices and weights rather than the expert-sorted copies the
``token_exchange`` seam gets, so `apply_ep` also swaps the experts module's ``forward`` for
:meth:`DeduplicatedExchange.dispatch` (the reference's EP step swaps ``forward`` too).
MindFormers de-duplicates at the node boundary (hence its ``expert_parallel >=
npu_nums_per_device`` rule): a token crosses to a node once and is fanned out inside it. This is
the same idea per destination rank, which on one node is all the de-duplication there is;
across nodes it is weaker (a token with experts on two ranks of one remote node crosses the
boundary twice), and ``npu_nums_per_device`` plays no part. Rows sent per token drop from k to
the number of distinct ranks among its experts. Measured with ``CommCounter`` on ep 2, 8 experts, 1024
uniformly routed tokens per rank, hidden 1024, forward plus backward: all-to-all bytes 0.78x
of ``alltoall`` at top-k 2, 0.62x at top-k 3, 0.49x at top-k 4 (64 experts: 0.75x, 0.60x,
0.47x); the extra ``k`` weight columns and the int32 expert ids cost about 1 % at hidden 1024.
The expert gradients and routing-weight gradients equal ``alltoall``'s bit for bit, outputs
too at top-k 2; at larger k only the order of the k-term sum differs (~1e-7 relative).

Both exchanges count the hidden-state rows they send (``rows_sent``), for tests and benchmarks.

Together with tensor parallelism (TP runs first): the families' TP plans keep the MoE block
whole on every TP rank (input all-gathered from the sequence-parallel slices, replicated
weights, each rank keeps its slice of the output), and turn its weights into replicated
DTensors on the tp mesh. `apply_ep` accepts those (they hold the full tensor) and re-shards the
experts over the ep mesh only: the ep groups are per TP coordinate (``ParallelDims``' ep view
leaves tp out), every TP rank of an ep rank holds the same experts and, since it routes and
dispatches the same all-gathered tokens, computes the same complete expert gradient. So the
expert gradients are reduced over the efsdp mesh only, never over tp (summing over tp would
count them tp times). ``tests/distributed/test_ep_dedup.py`` checks dp 2 x tp 2 with ep 2
against one process. The price is TP's: each TP rank repeats the MoE compute and the
all-to-all on the same tokens (a dispatch of each rank's sequence slice would avoid it; not
built: it needs the expert gradients reduced over tp and the router statistics summed over it).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshforge.models.common.moe import ExpertCompute, ExpertsBase, even_split, expert_counts, host_ints

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.models.spec import ExpertsAdapter, FamilySpec


def expert_types() -> tuple[type[nn.Module], ...]:
    """Experts containers that have the ``token_exchange`` seam and ``[num_experts, ...]`` weights.

    Each MoE family's spec names its type (``FamilySpec.moe.expert_type``).
    """
    from meshforge.models.registry import expert_types as family_expert_types

    return family_expert_types()


TOKEN_DISPATCHERS = ("alltoall", "alltoall_deredundancy")
EP_DISPATCHERS = ("eager",)


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertsBase]]:
    """``(name, module)`` of every MoE experts container in ``model``, in module order."""
    types = expert_types()
    # Every family's experts container (``FamilySpec.moe.expert_type``) subclasses ExpertsBase.
    return [(name, cast(ExpertsBase, m)) for name, m in model.named_modules() if isinstance(m, types)]


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is an experts container whose weights are sharded over an ep mesh.

    The families' containers and the experts modules a spec's ``ep_adapter`` handed an exchange
    (transformers' fused experts: ``meshforge.models.generic.experts``).
    """
    # A plain attribute (nn.Module keeps it in __dict__); unset on other modules.
    return isinstance(module.__dict__.get("token_exchange"), AllToAllExchange)


def apply_ep(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    *,
    token_dispatcher: str = "alltoall",
    dispatcher: str = "eager",
    modules: Sequence[str] | None = None,
    family: FamilySpec | None = None,
) -> None:
    """Shard every MoE block's experts over ``ep_mesh`` and route tokens to them by all-to-all.

    Call on the (meta or real) model after tensor parallelism and before FSDP; real weights are
    sliced locally (every rank holds the same full tensor), meta ones just get DTensor metadata.

    Args:
        model: A MoE family model (qwen3_moe, qwen3_next, deepseek_v3, gpt_oss, ...), or a
            model whose spec has an ``ep_adapter`` for its experts modules (the transformers
            path's fused Mixtral / Qwen3-MoE layout).
        ep_mesh: 1-D mesh of the ranks that share one copy of the experts.
        token_dispatcher: ``parallelism.moe_token_dispatcher_type``: ``alltoall`` (one row per
            (token, expert)) or ``alltoall_deredundancy`` (one row per (token, rank), see
            :class:`DeduplicatedExchange`).
        dispatcher: ``parallelism.ep_dispatcher``; only ``eager``.
        modules: ``parallelism.ep_modules`` patterns choosing which experts containers are
            sharded (None = all of them; with an ``ep_adapter``, the default patterns); the
            others stay whole on every rank, sharded by FSDP with their decoder layer.
        family: The model's spec (None: the registry's ``spec_of_model``).

    Raises:
        ValueError: the mesh is not 1-D, the model has no MoE experts, the expert count is
            not divisible by the ep degree (naming ``parallelism.expert_parallel`` and the
            model key), or expert weights are already split (FSDP applied first).
        NotImplementedError: another dispatcher, or a model family without the EP seam.
    """
    if token_dispatcher not in TOKEN_DISPATCHERS:
        raise NotImplementedError(
            f"not supported yet: parallelism.moe_token_dispatcher_type={token_dispatcher!r}; "
            f"supported: {', '.join(TOKEN_DISPATCHERS)}"
        )
    if dispatcher not in EP_DISPATCHERS:
        raise NotImplementedError(
            f"not supported yet: parallelism.ep_dispatcher={dispatcher!r}; supported: {', '.join(EP_DISPATCHERS)}"
        )
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep: the ep mesh must be 1-D, got {ep_mesh.ndim}-D {ep_mesh}")
    from meshforge.models.registry import expert_count_keys

    count_keys = expert_count_keys()
    family_name = str(getattr(model, "family", type(model).__name__))
    experts: Sequence[tuple[str, nn.Module]] = expert_modules(model)
    adapter = None if experts else _experts_adapter(model, family)
    if adapter is not None:
        # Experts modules that are no family container (transformers' own), chosen by
        # parallelism.ep_modules and checked by the spec's adapter.
        adapter.check_dispatcher(token_dispatcher)
        experts = adapted_experts(model, adapter, modules)
        modules = None
    if not experts:
        if not type(model).__module__.startswith("meshforge."):
            raise NotImplementedError(
                f"not supported yet: parallelism.expert_parallel > 1 for transformers models (the generic "
                f"path; {type(model).__name__}); built-in MoE families: {', '.join(sorted(count_keys))}"
            )
        if callable(getattr(model, "moe_layers", None)):  # a MoE family without the token_exchange seam
            raise NotImplementedError(f"not supported yet: parallelism.expert_parallel > 1 for {family_name}")
        raise ValueError(
            f"parallelism.expert_parallel: {ep_mesh.size()} needs a mixture-of-experts model, but "
            f"{family_name} has no routed experts; set it to 1"
        )
    if modules is not None:
        experts = _select_experts(model, expert_modules(model), modules)
    ep = ep_mesh.size()
    deduplicate = token_dispatcher == "alltoall_deredundancy"
    exchange = DeduplicatedExchange(ep_mesh) if deduplicate else AllToAllExchange(ep_mesh)
    for name, module in experts:  # check them all before changing any
        _check_not_sharded(name, module)
        # Both experts containers (GroupedExperts, GptOssExperts) store their expert count as an int.
        num_experts = cast(int, module.num_experts)
        if num_experts % ep:
            key = count_keys.get(family_name, "model.num_experts")
            raise ValueError(
                f"parallelism.expert_parallel: {ep} does not divide {key} = {num_experts} "
                f"(each rank holds num_experts / expert_parallel experts of {name})"
            )
    for _, module in experts:
        _shard_experts(module, ep_mesh)
        if adapter is not None:
            adapter.use_exchange(module, exchange)
            continue
        cast(ExpertsBase, module).token_exchange = exchange
        if deduplicate:
            # The de-duplicated exchange needs the tokens and routing weights, not the expert-sorted
            # copies of the seam: the module's forward becomes the exchange's dispatch.
            # Swapped per instance through nn.Module's own `forward: Callable[..., Any]` slot.
            target: nn.Module = module
            target.forward = types.MethodType(_deduplicated_forward, module)


def _experts_adapter(model: nn.Module, family: FamilySpec | None) -> ExpertsAdapter | None:
    """The adapter ``family`` (or the model's spec) gives for experts modules, else None."""
    if family is None:
        from meshforge.models.registry import spec_of_model

        family = spec_of_model(model)
    if family is None or family.ep_adapter is None:
        return None
    return family.ep_adapter()


def adapted_experts(
    model: nn.Module, adapter: ExpertsAdapter, patterns: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The modules ``parallelism.ep_modules`` names (None: its default), each checked by ``adapter``.

    Raises:
        ValueError: A pattern matches nothing (``parallelism.ep_modules``).
        NotImplementedError: The adapter refuses a matched module (naming its class and why).
    """
    from meshforge.parallel.config import MS_EP_MODULES
    from meshforge.utils.patterns import match_modules

    chosen = match_modules(
        model, list(patterns if patterns is not None else MS_EP_MODULES), key_path="parallelism.ep_modules"
    )
    for name, module in chosen:
        adapter.check(name, module)
    return chosen


def _select_experts(
    model: nn.Module, experts: list[tuple[str, ExpertsBase]], patterns: Sequence[str]
) -> list[tuple[str, ExpertsBase]]:
    """The experts containers matching ``parallelism.ep_modules``.

    Raises:
        ValueError: naming ``parallelism.ep_modules`` for a pattern that matches nothing or a
            module that is not an experts container.
    """
    from meshforge.utils.patterns import match_modules

    containers = {id(m): m for _, m in experts}
    chosen = []
    for name, module in match_modules(model, list(patterns), key_path="parallelism.ep_modules"):
        if id(module) not in containers:
            raise ValueError(
                f"parallelism.ep_modules: {name} ({type(module).__name__}) is not a MoE experts container; "
                f"they are: {', '.join(n for n, _ in experts[:3])}{', ...' if len(experts) > 3 else ''}"
            )
        chosen.append((name, containers[id(module)]))
    return chosen


def _check_not_sharded(name: str, module: nn.Module) -> None:
    """Refuse experts whose weights are already split (FSDP, or a tensor-parallel plan).

    Weights that tensor parallelism made replicated DTensors (its plans keep the MoE block whole
    on every TP rank) are whole on every rank, so they are accepted (see `_shard_experts`).
    """
    for pname, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor) and not all(isinstance(p, Replicate) for p in param.placements):
            raise ValueError(
                f"apply_ep: {name}.{pname} is already distributed ({param.placements}); apply EP "
                "before FSDP and on experts that tensor parallelism keeps whole"
            )


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace each ``[num_experts, ...]`` parameter by a ``Shard(0)`` DTensor on ``ep_mesh``."""
    for pname, param in list(module.named_parameters(recurse=False)):
        # A replicated DTensor (tensor parallelism's whole MoE block) holds the full tensor
        # locally; the experts then live on the ep mesh only, the same on every TP rank.
        data = param.data  # a DTensor exactly when param is one
        data = data.to_local() if isinstance(data, DTensor) else data
        # src_data_rank=None: every rank already holds the same full tensor (or meta), so each
        # keeps its slice without communication.
        sharded = distribute_tensor(data, ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))


class AllToAllExchange:
    """The eager all-to-all token exchange over one ep group (a ``TokenExchange``).

    One instance serves every MoE layer of the model: it holds the group and a counter.

    Args:
        ep_mesh: 1-D mesh; rank ``r`` of it holds experts ``[r * n_local, (r + 1) * n_local)``.

    Attributes:
        rows_sent: Hidden-state rows this rank has dispatched so far (all layers and forwards,
            its own rows included; the combine sends as many back). Plain Python int.
    """

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.rows_sent = 0

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
            # Fake tensors (a dry run): every rank sends its rows evenly and receives as much.
            both = host_ints(
                torch.cat([send_matrix.sum(1), recv_matrix.sum(1)]),
                lambda: even_split(grouped.shape[0], ep) * 2,
            )
            send_splits, recv_splits = both[:ep], both[ep:]
            # Received rows come source by source, each source's rows by local expert; the local
            # experts want them expert by expert: a stable sort by (expert, source) regroups them.
            chunk = torch.arange(ep * n_local, device=counts.device)
            chunk_of_row = torch.repeat_interleave(
                chunk, recv_counts.to(chunk.device), output_size=sum(recv_splits)
            )
            key = (chunk_of_row % n_local) * ep + chunk_of_row // n_local
            regroup = torch.argsort(key, stable=True)
            local_counts = recv_matrix.sum(0)
        self.rows_sent += grouped.shape[0]
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


class DeduplicatedExchange(AllToAllExchange):
    """``alltoall_deredundancy``: one row per (token, destination rank) instead of per (token, expert).

    Used through :meth:`dispatch`, which replaces the experts module's forward (`apply_ep`);
    the inherited ``__call__`` (the plain seam) still works for callers that only have
    expert-sorted copies.

    Each sent row carries the token's hidden state, its k routing weights and its k local
    expert ids on the destination (-1 for slots served elsewhere): one all-to-all when the ids
    are exact in the hidden states' dtype (local experts up to 256 in bf16, 2048 in fp16,
    2**24 in fp32), else the ids take a second, int32 one. Like ``alltoall`` it syncs with the
    host once per layer (the split sizes); the counts exchange also tells each rank how many
    (row, expert) pairs it will run. Routing weights in another dtype than the tokens
    (deepseek_v3's float32 weights under bf16 compute) travel in their own all-to-all, and the
    weighted sums come back in the promoted dtype, as the single-process mix computes them:
    exact, at twice the bytes per returned row in that case.

    The expert inputs on the destination are the same rows in the same order as with
    ``alltoall`` (grouped by local expert, then source rank, then token), so the expert
    outputs are identical; only the weighted sum of a token's k outputs is split into a
    partial sum per rank and a sum of those partial sums at the source (equal within rounding;
    bit for bit at top-k 2).
    """

    @torch.compiler.disable  # host syncs and collectives with data-dependent splits
    def dispatch(
        self,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        counts: torch.Tensor,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """``sum_j weights[:, j] * expert_{indices[:, j]}(x)`` with the experts spread over the ep group.

        Args:
            x: Tokens ``[N, hidden]``.
            indices: Chosen (global) experts ``[N, k]``.
            weights: Their routing weights ``[N, k]`` (gradient flows back to them).
            counts: Assignments per global expert ``[num_experts]`` (only its length is used).
            compute: The experts module's compute on its local experts.

        Returns:
            ``[N, hidden]``, as ``ExpertsBase.forward`` without EP.
        """
        ep = self.size
        num_tokens, top_k = indices.shape
        hidden = x.shape[-1]
        n_local = counts.numel() // ep
        with torch.no_grad():
            dest = torch.div(indices, n_local, rounding_mode="floor")  # [N, k] rank of each slot
            # Slot j represents its token on rank dest[n, j] when no earlier slot goes there.
            same = dest.unsqueeze(2) == dest.unsqueeze(1)
            earlier = torch.ones(top_k, top_k, dtype=torch.bool, device=dest.device).tril(-1)
            first = ~(same & earlier).any(-1).reshape(-1)
            flat_dest = dest.reshape(-1)
            # Representatives sorted by destination (token order inside one: stable), the other
            # slots after them under the key `ep`; no host sync until the split sizes.
            key = torch.where(first, flat_dest, ep)
            by_dest = torch.argsort(key, stable=True)
            rows_per_rank = expert_counts(key, ep + 1)[:ep]
            pairs_per_rank = expert_counts(flat_dest, ep)  # (row, expert) pairs to run there
            send_meta = torch.stack([rows_per_rank, pairs_per_rank], 1).reshape(-1)
            recv_meta = torch.empty_like(send_meta)
            dist.all_to_all_single(recv_meta, send_meta, group=self.group)
            host = host_ints(  # the one host sync
                torch.cat([send_meta, recv_meta]), lambda: _balanced_meta(num_tokens, top_k, ep) * 2
            )
            send_splits, recv_splits = host[0 : 2 * ep : 2], host[2 * ep :: 2]
            num_pairs = sum(host[2 * ep + 1 :: 2])
            num_recv = sum(recv_splits)
            rep = by_dest[: sum(send_splits)]  # representative slot of each sent row
            row_token = torch.div(rep, top_k, rounding_mode="floor")
            row_rank = flat_dest.index_select(0, rep)
            # Local expert ids on the row's destination; -1 for the slots served elsewhere.
            local_ids = indices.index_select(0, row_token) - row_rank.unsqueeze(1) * n_local
            serve = dest.index_select(0, row_token) == row_rank.unsqueeze(1)
            local_ids = torch.where(serve, local_ids, -1)
        self.rows_sent += rep.numel()
        # All k weights of the token travel; the destination uses those of its own slots (the
        # others multiply zero outputs there, so their gradient from this row is zero).
        rows = x.index_select(0, row_token)
        row_weights = weights.index_select(0, row_token)
        ids_inline = n_local <= _EXACT_INTEGERS.get(rows.dtype, 0)
        parts = [rows]
        if row_weights.dtype == rows.dtype:
            parts.append(row_weights)
        if ids_inline:
            parts.append(local_ids.to(rows.dtype))  # small integers: exact in this dtype
        received = _wait(
            all_to_all_single_autograd(torch.cat(parts, 1), recv_splits, send_splits, self.group)
        )
        rows_in = received[:, :hidden]
        if row_weights.dtype == rows.dtype:
            weights_in = received[:, hidden : hidden + top_k]
        else:  # keep the weights' own dtype, as the single-process mix does
            weights_in = _wait(all_to_all_single_autograd(row_weights, recv_splits, send_splits, self.group))
        with torch.no_grad():
            if ids_inline:
                ids = received[:, -top_k:].round().to(torch.int64)
            else:
                ids = local_ids.new_empty(num_recv, top_k, dtype=torch.int32)
                dist.all_to_all_single(
                    ids, local_ids.to(torch.int32), recv_splits, send_splits, group=self.group
                )
                ids = ids.to(torch.int64)
            # Group the received (row, slot) pairs by local expert; stable, so source rank then
            # token order inside an expert, exactly the rows `AllToAllExchange` would deliver.
            slot_key = torch.where(ids >= 0, ids, n_local).reshape(-1)
            position = torch.argsort(slot_key, stable=True)[:num_pairs]  # received slots m * k + j
            local_counts = expert_counts(slot_key, n_local + 1)[:n_local]
        local_in = rows_in.index_select(0, torch.div(position, top_k, rounding_mode="floor"))
        out = compute(local_in, local_counts)
        if out is None:
            out = local_in  # no rows: keep both all-to-alls in the graph (see AllToAllExchange)
        width = out.shape[-1]  # explicit sizes in the views: they may hold zero rows
        per_slot = out.new_zeros(num_recv * top_k, width).index_copy(0, position, out)
        combined = (per_slot.view(num_recv, top_k, width) * weights_in.unsqueeze(-1)).sum(dim=1)
        back = _wait(all_to_all_single_autograd(combined, send_splits, recv_splits, self.group))
        # Each returned row lands on its representative slot; the other slots stay zero.
        per_token = back.new_zeros(num_tokens * top_k, width).index_copy(0, rep, back)
        return per_token.view(num_tokens, top_k, width).sum(dim=1)


# Largest local expert id each payload dtype holds exactly (integers up to 2**mantissa bits).
_EXACT_INTEGERS = {torch.float32: 2**24, torch.float64: 2**53, torch.float16: 2**11, torch.bfloat16: 2**8}


def _deduplicated_forward(
    module: ExpertsBase, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``ExpertsBase.forward`` under ``alltoall_deredundancy`` (bound to the module by `apply_ep`)."""
    # apply_ep binds this forward only together with a DeduplicatedExchange.
    exchange = cast(DeduplicatedExchange, module.token_exchange)
    return exchange.dispatch(x, indices, weights, counts, module.compute)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a functional collective's (possibly asynchronous) result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def _balanced_meta(num_tokens: int, top_k: int, ep: int) -> list[int]:
    """[rows, pairs] per destination rank under balanced routing (fake tensors: no values).

    A token's k slots land on k uniformly chosen experts, so it is sent to a given rank with
    probability 1 - (1 - 1/ep)^k (its row travels once per rank it reaches) and brings k/ep
    (row, expert) pairs there on average.
    """
    rows = even_split(round(num_tokens * ep * (1 - (1 - 1 / ep) ** top_k)), ep)
    pairs = even_split(num_tokens * top_k, ep)
    return [v for pair in zip(rows, pairs, strict=True) for v in pair]


__all__ = [
    "expert_types",
    "AllToAllExchange",
    "DeduplicatedExchange",
    "adapted_experts",
    "apply_ep",
    "expert_modules",
    "is_expert_parallel",
]
