"""Muon's optimizer step against AdamW's, and the sharded Muon step against an all-gather baseline.

    .venv/bin/python benchmarks/muon_step.py                 # both parts, ~2 min on 2 cores
    .venv/bin/python benchmarks/muon_step.py --part single   # one process only
    .venv/bin/python benchmarks/muon_step.py --part dp --world 2

`single`: meshforge's Qwen3 (hidden 256, 4 layers, ffn 768, vocab 8192, ~7.3 M parameters, fp32)
with seeded random gradients, one thread per process; one `optimizer.step()` of `AdamW` (fused, as `optimizer.type: AdamW`
builds it) and of `Muon` (Newton-Schulz in float32 for the hidden matrices, fused AdamW for the
rest), timed alternately step by step; the median of each and their ratio.

`dp`: the same model under FSDP2 (`fully_shard` per layer, row shards) on `--world` gloo ranks.
The Muon step with owner-rank orthogonalisation (`optim/muon_dist.py`: gather each matrix to one
owner, orthogonalise, scatter the pieces back) against a baseline that all-gathers every matrix
on every rank (`full_tensor()`) and orthogonalises it everywhere. Bytes are those sent by all
ranks together (gather + scatter; for an all-gather, each rank's piece to every other rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _harness import emit
from torch import Tensor

from meshforge.models.qwen3.args import Qwen3Args
from meshforge.models.qwen3.model import Qwen3ForCausalLM
from meshforge.optim.build import build_optimizer
from meshforge.optim.muon import MeshMuon
from meshforge.optim.muon_dist import MatrixOrthogonalizer

ARGS = Qwen3Args(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(ARGS)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    return build_optimizer(
        model.named_parameters(),
        type=kind,
        learning_rate=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        weight_decay_include=None,
        weight_decay_exclude=None,
        options={},
    )


def _set_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen) * 1e-3
        from torch.distributed.tensor import DTensor, distribute_tensor

        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def single(steps: int) -> dict[str, object]:
    # One thread, as each dp rank below: on the shared 2-core machine two threads per matmul
    # were up to 17x slower under load (256 x 768 Newton-Schulz: 14 ms on 1 thread, 251 ms on 2).
    torch.set_num_threads(1)
    models = {kind: _model() for kind in ("AdamW", "Muon")}
    opts = {kind: _optimizer(m, kind) for kind, m in models.items()}
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for step in range(steps + 2):
        order = ("AdamW", "Muon") if step % 2 == 0 else ("Muon", "AdamW")
        for kind in order:
            _set_grads(models[kind], step)
            t = _timed(opts[kind].step)
            if step >= 2:  # warm-up: state allocation
                times[kind].append(t)
    adamw, muon = statistics.median(times["AdamW"]), statistics.median(times["Muon"])
    opt = opts["Muon"]
    assert isinstance(opt, MeshMuon)
    n_muon = sum(p.numel() for g in opt.param_groups if g["muon"] for p in g["params"])
    return {
        "case": "single",
        "params": sum(p.numel() for p in models["AdamW"].parameters()),
        "muon_params": n_muon,
        "adamw_step_ms": round(adamw * 1e3, 2),
        "muon_step_ms": round(muon * 1e3, 2),
        "muon_over_adamw": round(muon / adamw, 2),
        "steps": steps,
    }


class _AllGather(MatrixOrthogonalizer):
    """Baseline: every rank gathers every whole matrix and orthogonalises it."""

    def orthogonalize(
        self, params: Sequence[Tensor], updates: Sequence[Tensor], fn: Callable[[Tensor], Tensor]
    ) -> list[Tensor]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        out = []
        for param, update in zip(params, updates, strict=True):
            assert isinstance(param, DTensor)
            whole = DTensor.from_local(
                update, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            ).full_tensor()
            self.bytes_sent += update.numel() * update.element_size() * (dist.get_world_size() - 1)
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            result = fn(whole)
            out.append(
                result[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))].contiguous()
            )
        return out


def _dp_worker(rank: int, world: int, init: str, steps: int, queue: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, float] = {}
    for kind in ("owner", "allgather"):
        model = _model()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _optimizer(model, "Muon")
        assert isinstance(opt, MeshMuon)
        if kind == "allgather":
            opt._orth = _AllGather([p for g in opt.param_groups if g["muon"] for p in g["params"]])
        times = []
        for step in range(steps + 2):
            _set_grads(model, step)
            dist.barrier()
            t = _timed(opt.step)
            if step == 1:
                opt.orthogonalizer.bytes_sent = 0
            if step >= 2:
                times.append(t)
        sent = torch.tensor([float(opt.orthogonalizer.bytes_sent)])
        dist.all_reduce(sent)
        slowest = torch.tensor([statistics.median(times)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[f"{kind}_step_ms"] = round(slowest.item() * 1e3, 2)
        results[f"{kind}_MB_per_step"] = round(sent.item() / steps / 1e6, 3)
        results[f"{kind}_owned_on_rank0"] = opt.orthogonalizer.owned if kind == "owner" else -1
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def dp(world: int, steps: int) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_dp_worker, args=(r, world, init, steps, queue)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    results = queue.get()
    results.pop("allgather_owned_on_rank0")
    owned = results.pop("owner_owned_on_rank0")
    return {
        "case": f"dp{world}",
        **results,
        "matrices_owned_by_rank0": owned,
        "time_ratio": round(results["allgather_step_ms"] / results["owner_step_ms"], 2),
        "bytes_ratio": round(results["allgather_MB_per_step"] / results["owner_MB_per_step"], 2),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("single", "dp", "all"), default="all")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.part in ("single", "all"):
        emit(single(args.steps))
    if args.part in ("dp", "all"):
        emit(dp(args.world, args.steps))


if __name__ == "__main__":
    main()
