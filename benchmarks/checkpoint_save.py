"""How long a checkpoint save blocks the training loop: `checkpoint.async_save` vs a sync save.

A ~100M-parameter Qwen3 (hidden 768, 12 layers, vocab 32768, tied head) with its AdamW state
(one step taken, so the moments exist) is saved through meshforge's `CheckpointManager`, in one
process (a one-rank gloo group, as `meshforge train` makes), into a temporary folder on the disk
the run would use (`--dir`, default: the system temp folder).

* ``sync_blocking_s``: `save()` of a sync manager (DCP write, fsync, COMPLETE marker);
* ``async_blocking_s``: `save()` of an async manager: the state staged in host memory and the
  write handed to DCP's background thread; ``async_total_s`` adds the wait in `finalize()`
  (the write itself; the loop would keep training meanwhile);
* ``ratio`` = async_blocking / sync_blocking (target <= 0.1), medians over ``--repeats`` pairs
  that alternate which kind goes first; one warm-up save of each kind is not counted.

Run: ``python benchmarks/checkpoint_save.py [--repeats 3] [--dir DIR] [--layers 12]``.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshforge.checkpoint.manager import CheckpointManager  # noqa: E402
from meshforge.models.registry import build_model  # noqa: E402


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
    times: dict[str, list[float]] = {"sync": [], "async": [], "async_total": []}
    sizes_mb: list[float] = []
    step = 0

    def save(kind: str, record: bool) -> None:
        nonlocal step
        step += 1
        manager = sync if kind == "sync" else background
        t0 = time.perf_counter()
        target = manager.save(step, model, optimizer, {"step": step}, {"python": None})
        blocked = time.perf_counter() - t0
        manager.finalize()
        total = time.perf_counter() - t0
        if record:
            times[kind].append(blocked)
            if kind == "async":
                times["async_total"].append(total)
        sizes_mb.append(sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**20)

    try:
        save("sync", False)
        save("async", False)
        for r in range(args.repeats):
            for kind in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                save(kind, True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    sync_s, async_s = statistics.median(times["sync"]), statistics.median(times["async"])
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_save",
                "params": params,
                "checkpoint_mb": round(sizes_mb[-1], 1),
                "repeats": args.repeats,
                "sync_blocking_s": round(sync_s, 3),
                "async_blocking_s": round(async_s, 3),
                "async_total_s": round(statistics.median(times["async_total"]), 3),
                "ratio": round(async_s / sync_s, 3),
                "target": 0.1,
            }
        )
    )


if __name__ == "__main__":
    main()
