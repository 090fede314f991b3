"""How long a checkpoint save blocks the training loop: `checkpoint.async_save` vs a sync save.

A ~100M-parameter Qwen3 (hidden 768, 12 layers, vocab 32768, tied head) with its AdamW state
(one step taken, so the moments exist) is saved through meshforge's `CheckpointManager`, in one
process (a one-rank gloo group, as `meshforge train` makes), into a temporary folder on the disk
the run would use (`--dir`, default: the system temp folder).

* ``sync_blocking_s``: `save()` of a sync manager (DCP write, fsync, COMPLETE marker);
* ``async_blocking_s``: what the loop waits for with an async manager, as the trainer runs it:
  `save()` (hands the state to DCP's background copy and write), then the next step's forward
  and backward (``step_s``, batch 1 x ``--seq`` tokens; the copy runs meanwhile), then
  `wait_staging()` before that step's optimizer update; ``async_total_s`` is `save()` to the end
  of `finalize()` (the write itself; the loop would keep training meanwhile);
* ``async_copy_only_s``: `save()` + `wait_staging()` with no step between them: the blocking
  time of a loop whose step is shorter than the copy;
* ``ratio`` = async_blocking / sync_blocking (target <= 0.1), medians over ``--repeats`` rounds
  that alternate which kind goes first; one warm-up save of each kind is not counted (the async
  one allocates the host buffers that later saves reuse: ``first_async_copy_s``).

Run: ``python benchmarks/checkpoint_save.py [--repeats 3] [--dir DIR] [--layers 12] [--seq 256]``.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _harness import emit

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.models.registry import build_model


def _model(layers: int) -> torch.nn.Module:
    options = {
        "vocab_size": 32768,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "tie_word_embeddings": True,
    }
    return build_model("qwen3", options, device="cpu")


def _manager(root: Path, *, async_save: bool) -> CheckpointManager:
    return CheckpointManager(
        save_dir=root,
        prefix="ckpt",
        interval=1,
        keep=1,
        enabled=True,
        save_optimizer=True,
        rank=0,
        async_save=async_save,
        log=lambda _msg: None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256, help="tokens of the step between save and wait")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp folder)")
    args = parser.parse_args()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = _model(args.layers)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    sync, background = _manager(root / "sync", async_save=False), _manager(root / "async", async_save=True)
    times: dict[str, list[float]] = {
        "sync": [],
        "async": [],
        "async_total": [],
        "copy_only": [],
        "step": [],
        "first_copy": [],
    }
    sizes_mb: list[float] = []
    step = 0
    tokens = torch.randint(0, 32768, (1, args.seq))

    def forward_backward() -> None:
        model(tokens).float().square().mean().backward()
        optimizer.zero_grad(set_to_none=True)

    def save(kind: str, record: bool) -> None:
        nonlocal step
        step += 1
        manager = sync if kind == "sync" else background
        t0 = time.perf_counter()
        target = manager.save(step, model, optimizer, {"step": step}, {"python": None})
        blocked = time.perf_counter() - t0
        if kind == "async":
            t1 = time.perf_counter()
            forward_backward()
            t2 = time.perf_counter()
            manager.wait_staging()
            blocked += time.perf_counter() - t2
            times["step"].append(t2 - t1)
        elif kind == "copy_only":
            manager.wait_staging()
            blocked = time.perf_counter() - t0
            if not record:
                times["first_copy"].append(blocked)
        manager.finalize()
        total = time.perf_counter() - t0
        if record:
            times[kind].append(blocked)
            if kind == "async":
                times["async_total"].append(total)
        sizes_mb.append(sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**20)

    try:
        save("sync", False)
        save("copy_only", False)
        order = ("sync", "async", "copy_only")
        for r in range(args.repeats):
            for kind in order if r % 2 == 0 else order[::-1]:
                save(kind, True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    sync_s, async_s = statistics.median(times["sync"]), statistics.median(times["async"])
    emit(
        {
            "benchmark": "checkpoint_save",
            "params": params,
            "checkpoint_mb": round(sizes_mb[-1], 1),
            "repeats": args.repeats,
            "sync_blocking_s": round(sync_s, 3),
            "async_blocking_s": round(async_s, 3),
            "async_total_s": round(statistics.median(times["async_total"]), 3),
            "async_copy_only_s": round(statistics.median(times["copy_only"]), 3),
            "first_async_copy_s": round(times["first_copy"][0], 3),
            "step_s": round(statistics.median(times["step"]), 3),
            "seq": args.seq,
            "ratio": round(async_s / sync_s, 3),
            "copy_only_ratio": round(statistics.median(times["copy_only"]) / sync_s, 3),
            "target": 0.1,
        }
    )


if __name__ == "__main__":
    main()
