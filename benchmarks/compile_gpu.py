"""Eager vs compiled training steps of a ~1B Qwen3 in bf16 on one CUDA device, meshforge and transformers.

    python benchmarks/compile_gpu.py                     # CUDA: the 1B shape, 20 timed steps each
    python benchmarks/compile_gpu.py --steps 50 --batch 2 --peak-tflops 989
    python benchmarks/compile_gpu.py --cpu-smoke         # CPU: a tiny model, 3 timed steps, < 60 s

The model: Qwen3 with hidden 2048, 16 layers, ffn 6144, 16 heads / 8 KV heads of 128, vocabulary
151936 (tied), ~1.1 B parameters; batch 1 x sequence 4096 of random tokens; every parameter in
bf16, `torch.optim.AdamW(fused=True)`. The contenders are those of `step_throughput.py`
(`step_variants.py`): meshforge eager, meshforge compiled (`kernels.compile: true` through
meshforge's own code: each decoder layer compiled, the loss steps compiled, and at vocabulary
151,936 the fused linear cross-entropy), meshforge default (what `kernels` unwritten runs:
on CUDA the same as compiled) and transformers (sdpa attention) eager and under
`torch.compile(model)`, with the same weights and batch. They run one after the other, each
alone on the device (its peak memory is its own): warm-up steps, then timed steps; the first
step's time minus the median step's is the compile time (cold: a fresh
`TORCHINDUCTOR_CACHE_DIR` unless `--keep-cache`; `meshforge_default` compiles the same graphs
as `meshforge_compiled` just before it, so its `compile_s` is mostly the cache's reuse).

MFU = model FLOPs per token (meshforge's `flops_per_token`: 6 x matmul parameters + attention,
causal half not discounted) x tokens/s over the device's dense bf16 peak, looked up by device
name in `PEAK_BF16_TFLOPS` (`--peak-tflops` overrides it; unknown devices report no MFU).
Prints one JSON line: per variant tokens/s, MFU, compile time, peak memory and the first and
last losses, and the ratios against transformers eager (compiled also against compiled).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _harness import Runner, cpu_name, emit, families, utc_now  # noqa: E402
from step_variants import VARIANTS  # noqa: E402

from meshforge.models.qwen3.args import Qwen3Args  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the device name.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}

SHAPES = {
    "1b": dict(
        args=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        batch=1,
        seq=4096,
    ),
    "tiny": dict(
        args=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
        batch=2,
        seq=64,
    ),
}

VARIANT_ORDER = (
    "transformers_eager",
    "transformers_compiled",
    "meshforge_eager",
    "meshforge_compiled",
    "meshforge_default",
)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's dense bf16 peak: ``override``, else the table entry matching its name."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(
    variant: str,
    spec: dict,
    state: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
) -> dict:
    """Build one contender on ``device`` from ``state``, train it, and return its figures."""
    import transformers

    is_hf, make = VARIANTS[variant]
    args = Qwen3Args(**spec["args"], max_position_embeddings=max(4096, spec["seq"]), rope_theta=1e6)
    if is_hf:
        config = transformers.Qwen3Config(**{**args.to_hf_dict(), "use_cache": False})
        config._attn_implementation = "sdpa"
        model = transformers.Qwen3ForCausalLM(config)
    else:
        model = families()["qwen3"].model_cls(args)
    model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=torch.bfloat16).train()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    runner = Runner(variant, model, batch, is_hf, "fused", make(model))
    seconds, losses = [], []
    for _ in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(runner.step())  # .item() waits for the step
        seconds.append(time.perf_counter() - t0)
    timed = statistics.median(seconds[warmup:])
    tokens = batch["input_ids"].numel()
    result = {
        "tokens_per_s": round(tokens / timed, 1),
        "step_s": round(timed, 4),
        "first_step_s": round(seconds[0], 2),
        "compile_s": round(seconds[0] - timed, 2) if runner.fns.compiled else None,
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        ),
        "flops_per_token": model.flops_per_token(spec["seq"]) if not is_hf else None,
    }
    del runner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile included)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (1B shape: 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (1B shape: 4096)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANT_ORDER,
        default=None,
        help="contenders (default: all; with --cpu-smoke all but transformers_compiled, whose "
        "whole-model compile alone takes longer than the smoke run should on a CPU)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="device bf16 peak, TFLOP/s")
    parser.add_argument("--keep-cache", action="store_true", help="use the TORCHINDUCTOR_CACHE_DIR set")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, 3 timed steps")
    opts = parser.parse_args(argv)
    spec = dict(SHAPES["tiny" if opts.cpu_smoke else "1b"])
    spec["batch"] = opts.batch or spec["batch"]
    spec["seq"] = opts.seq or spec["seq"]
    warmup, steps = (2, 3) if opts.cpu_smoke else (opts.warmup, opts.steps)
    if opts.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(min(2, torch.get_num_threads()))
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        parser.error("no CUDA device: run with --cpu-smoke on a CPU machine")
    if not opts.keep_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-compile-gpu-")
    # One set of initial weights for every contender (transformers' initialisation, fp32 on CPU).
    import transformers

    torch.manual_seed(0)
    args = Qwen3Args(**spec["args"], max_position_embeddings=max(4096, spec["seq"]), rope_theta=1e6)
    config = transformers.Qwen3Config(**{**args.to_hf_dict(), "use_cache": False})
    state = {k: v.clone() for k, v in transformers.Qwen3ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1].contiguous().to(device), "labels": ids[:, 1:].contiguous().to(device)}
    peak = peak_tflops(device, opts.peak_tflops)
    results: dict[str, dict] = {}
    chosen = opts.variants or [
        v for v in VARIANT_ORDER if not (opts.cpu_smoke and v == "transformers_compiled")
    ]
    for variant in [v for v in VARIANT_ORDER if v in chosen]:
        results[variant] = run_variant(variant, spec, state, batch, device=device, warmup=warmup, steps=steps)
    flops = next((r["flops_per_token"] for r in results.values() if r["flops_per_token"]), None)
    for r in results.values():
        r.pop("flops_per_token")
        r["mfu"] = round(flops * r["tokens_per_s"] / (peak * 1e12), 4) if flops and peak else None
    speed = {k: r["tokens_per_s"] for k, r in results.items()}
    ratios = {}
    for name in ("meshforge_eager", "meshforge_compiled", "meshforge_default", "transformers_compiled"):
        if name in speed and "transformers_eager" in speed:
            ratios[f"{name}/transformers_eager"] = round(speed[name] / speed["transformers_eager"], 3)
    if "meshforge_compiled" in speed and "transformers_compiled" in speed:
        ratios["meshforge_compiled/transformers_compiled"] = round(
            speed["meshforge_compiled"] / speed["transformers_compiled"], 3
        )
    out = {
        "benchmark": "compile_gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "peak_bf16_tflops": peak,
        "shape": {**spec["args"], "batch": spec["batch"], "seq": spec["seq"]},
        "params": sum(v.numel() for k, v in state.items() if k != "lm_head.weight"),
        "flops_per_token": flops,
        "dtype": "bfloat16",
        "warmup": warmup,
        "timed_steps": steps,
        "variants": results,
        "ratios": ratios,
        "torch": torch.__version__,
        "date": utc_now(),
    }
    emit(out)


if __name__ == "__main__":
    main()
