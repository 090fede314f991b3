"""Step throughput of the families transformers has no model for: meshforge alone, no ratio.

`step_throughput.py --family step3p5` runs this: the FLOPs and the share of the matmul peak are
the figures (the same loop, batch and AdamW as the paired runs there).
"""

from __future__ import annotations

from typing import Any

import torch
from _harness import Runner, median_high, mm_rate, shape_batch, utc_now

from meshforge.models.step3p5.args import FLAVORS as STEP3P5_FLAVORS
from meshforge.models.step3p5.model import build_step3p5

# step3p5's small shape: its tiny flavor (full + 3 sliding layers, window 64).
ALONE: dict[str, dict[str, Any]] = {
    "step3p5": {
        "small": dict(build=lambda: build_step3p5(STEP3P5_FLAVORS["tiny"], device="cpu"), batch=8, seq=256)
    },
}


def run_alone(
    family_name: str, name: str, spec: dict, *, warmup: int, repeats: int, peak: float, adamw: str
) -> dict:
    """Step throughput of a family without a transformers model: meshforge's own figures only."""
    torch.manual_seed(0)
    model = spec["build"]().train()
    batch = shape_batch(spec, model.args.vocab_size)
    runner = Runner("meshforge", model, batch, False, adamw)
    for _ in range(warmup):
        runner.step()
    mm_a, mm_b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak_samples = [peak]
    for _ in range(repeats):
        runner.timed_block(1)
        peak_samples.append(mm_rate(mm_a, mm_b))
    flops = model.flops_per_token(spec["seq"]) * batch["input_ids"].numel()
    median_gflops = flops / median_high(runner.block_seconds) / 1e9
    return {
        "family": family_name,
        "shape": name,
        "batch": spec["batch"],
        "seq": spec["seq"],
        "params": model.num_params(),
        "active_params": model.num_params(active=True),
        "tokens_per_s": {"meshforge": round(runner.tokens_per_s, 1)},
        "gflops_median_step": round(median_gflops, 2),
        "share_of_peak": round(median_gflops / median_high(peak_samples), 3),
        "mm_peak_gflops_median": round(median_high(peak_samples), 1),
        "last_loss": round(runner.losses[-1], 5),
        "date": utc_now(),
    }
