"""``moe_token_dispatcher_type: alltoall_deredundancy`` equals ``alltoall`` and one process, sending fewer rows.

One 2-process gloo spawn (ep 2), with the model helpers of ``test_ep.py``:

* models (qwen3_moe, deepseek_v3, gpt_oss; qwen3_moe also under expert-FSDP): logits,
  cross-entropy, router aux loss and every gradient of the de-duplicated EP model equal the
  single-process model run on every rank's rows (1e-5 relative), and equal the ``alltoall`` EP
  model on the same rank;
* exchange (one experts module, 8 experts, top-k 2, 3 and 4, routings with and without
  tokens whose experts share a rank, and a rank without tokens): outputs and the gradients of
  the tokens, the routing weights and the experts equal one process; ``rows_sent`` is exactly
  the number of distinct (token, rank) pairs, fewer than ``alltoall``'s ``N * k`` whenever a
  token has two experts on one rank, and the all-to-all bytes counted by ``CommCounter`` drop
  accordingly.

A second spawn (4 processes) runs expert parallelism together with tensor parallelism, the
layout the trainer builds for ``expert_parallel`` with ``tensor_parallel`` (docs/architecture.md,
"Departures": the MoE block stays whole on each TP rank, EP shards its experts): dp 2 x tp 2 with
ep 2 over the data ranks, qwen3_moe (both dispatchers) and deepseek_v3, equal to one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._compare import rel_error
from tests.distributed._spawn import run_workers
from tests.distributed.test_ep import BATCH, _batch, _build, _full_grad, _materialize, _objective

pytestmark = pytest.mark.slow

TOL = 1e-5


def _ep_model(family: str, token_dispatcher: str, *, fsdp: bool):
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import apply_fsdp

    world = dist.get_world_size()
    model = _build(family)
    dims = ParallelDims(world_size=world, dp_shard=world, ep=2)
    mesh = dims.build_mesh("cpu")
    apply_ep(model, dims.mesh_for(mesh, "ep"), token_dispatcher=token_dispatcher)
    if fsdp:
        apply_fsdp(
            model,
            dims.mesh_for(mesh, "fsdp"),
            expert_mesh=dims.mesh_for(mesh, "efsdp"),
            param_dtype=None,
            reduce_dtype=torch.float32,
        )
    _materialize(model)
    return model


def _rows_sent(model) -> int:
    from meshforge.parallel.expert import expert_modules

    exchanges = {id(m.token_exchange): m.token_exchange for _, m in expert_modules(model)}
    return sum(e.rows_sent for e in exchanges.values())


def _check_model(family: str, errors: list[str], *, fsdp: bool = False) -> None:
    """De-duplicated EP model against one process and against ``alltoall`` on this rank's rows."""
    from meshforge.parallel.expert import DeduplicatedExchange, expert_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _build(family)
    _materialize(reference)
    ids, labels = _batch(world, reference.args.vocab_size)
    expected = None
    for r in range(world):  # one process runs every rank's rows as micro-batches
        part = slice(r * BATCH, (r + 1) * BATCH)
        logits, ce, aux, objective = _objective(reference, ids[part], labels[part], world)
        objective.backward()
        if r == rank:
            expected = (logits.detach(), ce.detach(), None if aux is None else aux.detach())
    assert expected is not None
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    results = {}
    for dispatcher in ("alltoall", "alltoall_deredundancy"):
        model = _ep_model(family, dispatcher, fsdp=fsdp)
        logits, ce, aux, objective = _objective(model, ids[rows], labels[rows], world)
        objective.backward()
        grads = {name: _full_grad(p, reduce_plain=not fsdp) for name, p in model.named_parameters()}
        results[dispatcher] = (logits.detach(), ce.detach(), aux, grads, _rows_sent(model))
        if dispatcher == "alltoall_deredundancy":
            kinds = {type(m.token_exchange) for _, m in expert_modules(model)}
            if kinds != {DeduplicatedExchange}:
                errors.append(f"{family}: exchanges are {kinds}")

    tag = f"{family}{'/fsdp' if fsdp else ''}/rank{rank}"
    logits, ce, aux, grads, dedup_rows = results["alltoall_deredundancy"]
    plain = results["alltoall"]
    for what, got, want in (("logits", logits, expected[0]), ("cross-entropy", ce, expected[1])):
        if rel_error(got, want) > TOL:
            errors.append(f"{tag}: {what} differ from one process by {rel_error(got, want):.2e}")
    if rel_error(logits, plain[0]) > TOL:
        errors.append(f"{tag}: logits differ from alltoall by {rel_error(logits, plain[0]):.2e}")
    if (aux is None) != (expected[2] is None) or (
        aux is not None and rel_error(aux.detach(), expected[2]) > TOL
    ):
        errors.append(f"{tag}: aux loss {aux} vs {expected[2]}")
    ref_params = dict(reference.named_parameters())
    for name, grad in grads.items():
        want = ref_params[name].grad
        if want is None:  # deepseek's score-correction bias gets no gradient
            want = torch.zeros_like(grad)
        if rel_error(grad, want) > TOL and (grad - want).abs().max() > 1e-9:
            errors.append(
                f"{tag}: gradient of {name} differs from one process by {rel_error(grad, want):.2e}"
            )
        if rel_error(grad, plain[3][name]) > TOL and (grad - plain[3][name]).abs().max() > 1e-9:
            errors.append(f"{tag}: gradient of {name} differs from alltoall")
    if not 0 < dedup_rows <= plain[4]:
        errors.append(f"{tag}: deduplicated exchange sent {dedup_rows} rows, alltoall {plain[4]}")


def _full_experts(num_experts: int, hidden: int):
    from meshforge.models.common.moe import GroupedExperts

    experts = GroupedExperts(num_experts, hidden, 6)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts


def _check_exchange(errors: list[str], measured: dict[str, float]) -> None:
    """Experts module alone: equality with one process (tokens, weights, experts) and row counts."""
    from unittest import mock

    import meshforge.parallel.expert as expert_module
    from meshforge.parallel.expert import apply_ep
    from meshforge.utils.comms import CommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    ep_mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    num_experts, hidden, n = 8, 64, 12
    gen = torch.Generator().manual_seed(7)

    def random_routing(k: int, m: int) -> torch.Tensor:  # k distinct experts per token
        rows = [torch.randperm(num_experts, generator=gen)[:k] for _ in range(m)]
        return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)

    scenarios = {f"random top-{k}": [random_routing(k, n) for _ in range(world)] for k in (2, 3, 4)}
    # Every token's two experts on different ranks: nothing to de-duplicate.
    spread = torch.stack([torch.arange(n) % 4, 4 + (torch.arange(n) + 1) % 4], 1)
    scenarios["no duplicates"] = [spread, spread.flip(1)]
    # Rank 1 has no tokens (it still receives rows and joins every collective).
    scenarios["rank 1 without tokens"] = [random_routing(3, n), random_routing(3, 0)]
    # Weights in another dtype than the tokens (deepseek_v3's float32 weights under bf16) travel
    # in their own all-to-all, and the weighted sums in the promoted dtype, as one process mixes.
    scenarios["float64 weights"] = [random_routing(2, n) for _ in range(world)]
    for scenario, indices in scenarios.items():
        k = indices[0].shape[1]
        xs = [torch.randn(i.shape[0], hidden, generator=gen) for i in indices]
        wdtype = torch.float64 if "float64" in scenario else torch.float32
        weights = [torch.rand(i.shape[0], k, generator=gen, dtype=wdtype) for i in indices]
        targets = [torch.randn(i.shape[0], hidden, generator=gen) for i in indices]
        reference = _full_experts(num_experts, hidden)
        total = torch.zeros(())
        expected = None
        for r in range(world):
            x, w = xs[r].clone().requires_grad_(True), weights[r].clone().requires_grad_(True)
            out = reference(x, indices[r], w, torch.bincount(indices[r].flatten(), minlength=num_experts))
            total = total + (out * targets[r]).sum()
            if r == rank:
                expected = (out, x, w)
        total.backward()
        assert expected is not None
        sent, volume, got_all = {}, {}, {}
        # "ids apart": the expert ids in their own int32 all-to-all (as when they are not exact
        # in the tokens' dtype).
        for dispatcher in ("alltoall", "alltoall_deredundancy", "ids apart"):
            experts = _full_experts(num_experts, hidden)
            apart = dispatcher == "ids apart"
            apply_ep(experts, ep_mesh, token_dispatcher="alltoall_deredundancy" if apart else dispatcher)
            x, w = xs[rank].clone().requires_grad_(True), weights[rank].clone().requires_grad_(True)
            counts = torch.bincount(indices[rank].flatten(), minlength=num_experts)
            exact = {} if apart else expert_module._EXACT_INTEGERS
            with CommCounter() as counter, mock.patch.object(expert_module, "_EXACT_INTEGERS", exact):
                out = experts(x, indices[rank], w, counts)
                (out * targets[rank]).sum().backward()
            sent[dispatcher] = experts.token_exchange.rows_sent
            got_all[dispatcher] = [
                out.detach(),
                x.grad,
                w.grad,
                *(p.grad.to_local() for p in experts.parameters()),
            ]
            volume[dispatcher] = counter.bytes["all_to_all_single"]
            tag = f"exchange {scenario}/{dispatcher}/rank{rank}"
            if out.shape != expected[0].shape or (
                out.numel() and rel_error(out.detach(), expected[0].detach()) > TOL
            ):
                errors.append(f"{tag}: outputs differ")
            for what, got, want in (
                ("tokens", x.grad, expected[1].grad),
                ("weights", w.grad, expected[2].grad),
            ):
                if got is None or got.shape != want.shape or (got.numel() and rel_error(got, want) > TOL):
                    errors.append(f"{tag}: gradient of the {what} differs")
            for name, param in experts.named_parameters():
                got = _full_grad(param, reduce_plain=False)  # a DTensor: the full expert gradient
                if rel_error(got, reference.get_parameter(name).grad) > TOL:
                    errors.append(f"{tag}: gradient of {name} differs")
        # Against alltoall on the same rank: the same expert inputs, so the expert gradients and
        # the weights' gradients agree bit for bit; outputs and token gradients differ only in
        # the order of the k-term sums (bit for bit at k = 2, where a + b == b + a).
        for variant in ("alltoall_deredundancy", "ids apart"):
            for i, (a, b) in enumerate(zip(got_all["alltoall"], got_all[variant], strict=True)):
                if not (torch.equal(a, b) if k == 2 or i >= 2 else a.numel() == 0 or rel_error(b, a) < 1e-6):
                    errors.append(
                        f"exchange {scenario}/{variant}/rank{rank}: result {i} differs from alltoall"
                    )
        pairs = {
            (t, int(e) // (num_experts // world)) for t, row in enumerate(indices[rank].tolist()) for e in row
        }
        if sent["alltoall"] != indices[rank].numel() or sent["alltoall_deredundancy"] != len(pairs):
            errors.append(
                f"{scenario}/rank{rank}: rows sent {sent}, expected {indices[rank].numel()} and {len(pairs)}"
            )
        # Bytes: each sent row also carries k weights and k expert ids (2k columns, 1/8 of a row
        # at hidden 64 and k 4), so they must drop once a fifth of the rows are saved. (With
        # float64 weights the weighted sums return in float64, twice the bytes of a row.)
        plenty = len(pairs) <= 0.8 * indices[rank].numel()
        if plenty and wdtype == torch.float32 and not volume["alltoall_deredundancy"] < volume["alltoall"]:
            errors.append(f"{scenario}/rank{rank}: all-to-all bytes {volume} did not drop")
        if scenario.startswith("random"):
            measured[f"{scenario} rows"] = sent["alltoall_deredundancy"] / sent["alltoall"]
            measured[f"{scenario} bytes"] = volume["alltoall_deredundancy"] / volume["alltoall"]


def _check_ep_with_tp(family: str, dispatcher: str, errors: list[str]) -> None:
    """4 ranks, dp 2 x tp 2 with ep 2 over the data ranks: the MoE block stays whole on every TP
    rank (the families' TP plans), its experts sharded over EP and the same on both TP ranks;
    logits, losses and every gradient equal one process."""
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import apply_fsdp
    from meshforge.parallel.tensor import apply_tp

    dims = ParallelDims(world_size=dist.get_world_size(), dp_shard=2, tp=2, ep=2)
    mesh = dims.build_mesh("cpu")
    dp_rank = dims.mesh_for(mesh, "batch").get_local_rank()
    reference = _build(family)
    _materialize(reference)
    ids, labels = _batch(dims.dp, reference.args.vocab_size)
    expected = None
    for r in range(dims.dp):
        part = slice(r * BATCH, (r + 1) * BATCH)
        logits, ce, aux, objective = _objective(reference, ids[part], labels[part], dims.dp)
        objective.backward()
        if r == dp_rank:
            expected = (logits.detach(), ce.detach(), None if aux is None else aux.detach())
    assert expected is not None

    model = _build(family)
    apply_tp(model, dims.mesh_for(mesh, "tp"), family=family, sequence_parallel=True)
    apply_ep(model, dims.mesh_for(mesh, "ep"), token_dispatcher=dispatcher)
    apply_fsdp(
        model,
        dims.mesh_for(mesh, "fsdp"),
        expert_mesh=dims.mesh_for(mesh, "efsdp"),
        param_dtype=None,
        reduce_dtype=torch.float32,
    )
    _materialize(model)
    rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    logits, ce, aux, objective = _objective(model, ids[rows], labels[rows], dims.dp)
    objective.backward()
    tag = f"{family}/dp2 tp2 ep2/{dispatcher}/rank{dist.get_rank()}"
    for what, got, want in (
        ("logits", logits.detach(), expected[0]),
        ("cross-entropy", ce.detach(), expected[1]),
    ):
        if rel_error(got, want) > TOL:
            errors.append(f"{tag}: {what} differ by {rel_error(got, want):.2e}")
    if (aux is None) != (expected[2] is None) or (
        aux is not None and rel_error(aux.detach(), expected[2]) > TOL
    ):
        errors.append(f"{tag}: aux loss {aux} vs {expected[2]}")
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = _full_grad(param, reduce_plain=False)
        want = ref_params[name].grad
        if want is None:
            want = torch.zeros_like(grad)
        if ".experts." in name and tuple(param.to_local().shape) == tuple(param.shape):
            errors.append(f"{tag}: {name} is not sharded")
        if rel_error(grad, want) > TOL and (grad - want).abs().max() > 1e-9:
            errors.append(f"{tag}: gradient of {name} differs by {rel_error(grad, want):.2e}")


def _worker_ep_tp(rank: int, world: int) -> None:
    errors: list[str] = []
    _check_ep_with_tp("qwen3_moe", "alltoall", errors)
    _check_ep_with_tp("qwen3_moe", "alltoall_deredundancy", errors)
    _check_ep_with_tp("deepseek_v3", "alltoall_deredundancy", errors)
    assert not errors, "\n".join(errors)


def _worker(rank: int, world: int) -> None:
    errors: list[str] = []
    measured: dict[str, float] = {}
    checks = [
        lambda: _check_exchange(errors, measured),
        lambda: _check_model("qwen3_moe", errors),
        lambda: _check_model("deepseek_v3", errors),
        lambda: _check_model("gpt_oss", errors),
        lambda: _check_model("qwen3_moe", errors, fsdp=True),
    ]
    for check in checks:
        check()
    assert not errors, "\n".join(errors)
    if rank == 0:
        print("dedup/alltoall ratios (rank 0):", {k: round(v, 3) for k, v in measured.items()}, flush=True)


def test_deduplicated_dispatch_equals_alltoall_and_one_process() -> None:
    run_workers(_worker, 2)


def test_ep_with_tensor_parallel_equals_one_process() -> None:
    """Expert parallelism together with TP (dp 2 x tp 2, ep 2 over the data ranks) equals one process."""
    run_workers(_worker_ep_tp, 4)
