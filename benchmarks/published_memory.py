"""The per-device memory model against published peak memory: predicted / published.

Every run of the `memory` group of `published_runs.yaml` is planned by `predict_device_peak`
(`src/meshforge/parallel/device_peak.py`) with the published layout as overrides of a shipped
example and the model's published config.json (edited by `model_changes` where the model has no
folder here). torchtitan reports `max_memory_reserved` under expandable segments, so the
prediction compared is `DevicePeak.reserved` (the compute stream's allocated bytes with the
fragmentation the allocator replay measures, plus FSDP2's collective streams' pools); the
allocated bytes' ratio is printed beside it. One JSON line per run, then the spreads.

Where the loss is the step's peak, torchtitan's loss is not meshforge's: it runs
`F.cross_entropy(pred.float(), labels)` (under tensor parallelism inside `loss_parallel()`,
DTensor's log-softmax and nll handlers), meshforge `cross_entropy_sum` (vocabulary-parallel,
Megatron's way). Both are measured here, forward and backward, on fake tensors at the run's
per-rank shapes (torch's fake process group for the TP ranks); the prediction of torchtitan's
run adds the difference (`loss_extra_gib`).

    PYTHONPATH=src .venv/bin/python benchmarks/published_memory.py      # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from _harness import emit

from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import FRAGMENTATION, predict_device_peak
from meshforge.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).with_name("published_runs.yaml")
_GIB = 1024**3

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def predict(run: dict[str, Any], folder: Path, index: int) -> dict[str, Any]:
    model_dir = folder / f"model{index}"
    model_dir.mkdir()
    config = json.loads((ROOT / run["model_config"]).read_text(encoding="utf-8"))
    config.update(run.get("model_changes") or {})
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    overrides = [*run["overrides"], f"--model.model_name_or_path={model_dir}"]
    cfg = load_config(str(ROOT / run["config"]), overrides, log=lambda _: None)
    world = int(run["world_size"])
    peak = predict_device_peak(cfg, world)
    published = float(run["memory_gib"])
    extra = 0.0
    if peak.phase == "loss":
        dims = ParallelDims.from_config(cfg.parallelism, world)
        tokens = int(cfg.training.local_batch_size) * int(cfg.train_dataset.seq_length() or 0) // dims.cp
        extra = loss_extra(tokens, int(config["vocab_size"]), dims.tp)
    # torchtitan's run: its loss in the compute stream's pool.
    reserved = peak.reserved + extra * FRAGMENTATION
    return {
        "run": run["name"],
        "published_gib": published,
        "predicted_allocated_gib": round(peak.allocated / _GIB, 2),
        "predicted_reserved_gib": round(peak.reserved / _GIB, 2),
        "loss_extra_gib": round(extra / _GIB, 2),
        "ratio_over_allocated": round(published * _GIB / peak.allocated, 3),
        "ratio_over_reserved": round(published * _GIB / reserved, 3),
        "phase": peak.phase,
        "stage": peak.stage,
        "components_gib": {k: round(v / _GIB, 2) for k, v in peak.components().items()},
    }


def loss_peak(tokens: int, vocab: int, tp: int, *, torchtitan: bool) -> int:
    """Peak bytes of one loss forward and backward from bfloat16 logits `[tokens, vocab / tp]`
    (the logits included), on fake tensors: torchtitan's or meshforge's cross-entropy."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.train.dry_run import fake_world

    with fake_world(0, tp):
        mesh = init_device_mesh("cpu", (tp,))
        return _loss_peak(mesh, tokens, vocab, tp, torchtitan=torchtitan)


def _loss_peak(mesh: DeviceMesh, tokens: int, vocab: int, tp: int, *, torchtitan: bool) -> int:
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.train.dry_run_record import new_step_peak
    from meshforge.utils.fake_memory import sharding_propagation_untracked

    with FakeTensorMode():
        head = torch.empty(tokens, vocab // tp, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(tokens, dtype=torch.long)
        memory = new_step_peak()
        with sharding_propagation_untracked(), memory:
            local = head * 1  # the head's output: freed before backward, as both trainers do
            logits = DTensor.from_local(local, mesh, [Shard(-1)], run_check=False) if tp > 1 else local
            del local
            if torchtitan and tp > 1:
                with loss_parallel():
                    target = DTensor.from_local(labels, mesh, [Replicate()], run_check=False)
                    loss = F.cross_entropy(logits.float(), target)
                    del logits
                    loss.backward()
            elif torchtitan:
                loss = F.cross_entropy(logits.float(), labels)
                del logits
                loss.backward()
            else:
                loss = cross_entropy_sum(logits, labels)
                del logits
                loss.backward()
        return int(max(memory._peak_mem.values()))


def loss_extra(tokens: int, vocab: int, tp: int) -> float:
    """Bytes torchtitan's loss holds at its peak beyond meshforge's (measured, never negative)."""
    titan = loss_peak(tokens, vocab, tp, torchtitan=True)
    return float(max(0, titan - loss_peak(tokens, vocab, tp, torchtitan=False)))


def main() -> None:
    runs = yaml.safe_load(RUNS.read_text(encoding="utf-8"))["memory"]
    allocated, reserved = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index, run in enumerate(runs):
            record = predict(run, Path(tmp), index)
            allocated.append(record["ratio_over_allocated"])
            reserved.append(record["ratio_over_reserved"])
            emit(record)
    emit(
        {
            "runs": len(reserved),
            "over_allocated_min": min(allocated),
            "over_allocated_max": max(allocated),
            "over_reserved_min": min(reserved),
            "over_reserved_max": max(reserved),
        }
    )


if __name__ == "__main__":
    main()
