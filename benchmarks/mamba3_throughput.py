"""Training-step throughput of the Mamba-3 family: the chunked scan vs the token-by-token recurrence.

No transformers class exists for Mamba-3, so ``step_throughput.py --family mamba3`` compares
meshforge's two ways of running the same layer: the chunked scan (``scan = "chunked"``, what
training uses) against the step recurrence of the paper's equations (``scan = "recurrent"``,
the tests' reference). Both models have the same weights, batch and fused AdamW and run the
same plain loop as ``step_throughput.py`` (steps alternate one by one, the order flips every
repeat); their losses agree (``last_loss``), which checks that they do the same work. Reported
``ratio`` is chunked over recurrent tokens/s; ``ratio_median_of_pairs`` as in
``step_throughput.py``. Model FLOPs per token are the chunked model's ``flops_per_token``.
"""

from __future__ import annotations

import torch
from _harness import Runner, emit, median_high, utc_now

from meshforge.models.mamba3.args import Mamba3Args
from meshforge.models.mamba3.model import build_mamba3

_TRUNK = dict(vocab_size=8192, hidden_size=128, num_hidden_layers=2, state_size=32, head_dim=32)
# The step recurrence keeps every token's state for the backward (batch x heads x head_dim x
# state floats per token and layer), so the shapes stay small.
SHAPES = {
    # 8 SISO heads of 32, state 32, chunks of 32; batch 4 x seq 128.
    "small": dict(args=Mamba3Args(**_TRUNK, chunk_size=32), batch=4, seq=128),
    # The same with MIMO rank 4 (chunks of 8: the reference recommends chunk 64 / rank in bf16).
    "mimo": dict(args=Mamba3Args(**_TRUNK, is_mimo=True, mimo_rank=4, chunk_size=8), batch=4, seq=128),
}


def run_shape(name: str, spec: dict, *, warmup: int, steps: int, repeats: int, adamw: str) -> dict:
    args: Mamba3Args = spec["args"]
    torch.manual_seed(0)
    chunked = build_mamba3(args, device="cpu").train()
    recurrent = build_mamba3(args, device="cpu").train()
    recurrent.load_state_dict(chunked.state_dict())
    recurrent.set_scan("recurrent")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (spec["batch"], spec["seq"]), generator=g)
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    runners = [
        Runner("recurrent", recurrent, batch, False, adamw),
        Runner("chunked", chunked, batch, False, adamw),
    ]
    for r in runners:
        for _ in range(warmup):
            r.step()
    for i in range(repeats):
        for r in runners if i % 2 == 0 else runners[::-1]:
            r.timed_block(steps)
    theirs, mine = runners
    pair_ratios = sorted(t / m for t, m in zip(theirs.block_seconds, mine.block_seconds, strict=True))
    flops = chunked.flops_per_token(spec["seq"])
    return {
        "family": "mamba3",
        "shape": name,
        "batch": spec["batch"],
        "seq": spec["seq"],
        "hidden": args.hidden_size,
        "layers": args.num_hidden_layers,
        "heads": args.num_heads,
        "state": args.state_size,
        "mimo_rank": args.rank,
        "chunk_size": args.chunk_size,
        "params": chunked.num_params(),
        "tokens_per_s": {r.name: round(r.tokens_per_s, 1) for r in runners},
        "ratio": round(mine.tokens_per_s / theirs.tokens_per_s, 3),
        "ratio_median_of_pairs": round(pair_ratios[len(pair_ratios) // 2], 3),
        "ratio_cpu_time": round(theirs.cpu_seconds / mine.cpu_seconds, 3),
        "gflops": {r.name: round(flops * r.tokens_per_s / 1e9, 2) for r in runners},
        "ms_per_step_median": {r.name: round(1e3 * median_high(r.block_seconds) / steps, 1) for r in runners},
        "last_loss": {r.name: round(r.losses[-1], 5) for r in runners},
        "adamw": adamw,
        "timed_steps_each": steps * repeats,
        "threads": torch.get_num_threads(),
        "date": utc_now(),
    }


def main(
    *, shape: str, quick: bool, warmup: int | None, steps: int | None, repeats: int | None, adamw: str
) -> None:
    """Print one JSON line per shape (``shape``: a name of ``SHAPES`` or ``all``)."""
    names = list(SHAPES) if shape == "all" else [shape]
    for name in names:
        result = run_shape(
            name,
            SHAPES[name],
            warmup=warmup if warmup is not None else 1,
            steps=steps if steps is not None else 1,
            repeats=repeats if repeats is not None else (2 if quick else 6),
            adamw=adamw,
        )
        emit(result)


__all__ = ["SHAPES", "main", "run_shape"]
