"""Training-step throughput: built-in models, eager and compiled, vs transformers' own on CPU.

Families: ``qwen3`` (dense; shapes ``small`` and ``large``), ``qwen3_moe`` and
``deepseek_v3`` (tiny-ish MoE shape ``small`` each), each against transformers'
``*ForCausalLM`` of the same family (shapes and families: ``_harness.py``). Five
contenders (``step_variants.py``): meshforge eager, meshforge compiled (``layer.compile()`` on every decoder layer and a
``torch.compile``d loss), meshforge default (what ``kernels`` unwritten runs), transformers
eager and transformers under ``torch.compile(model)`` (with the same compiled loss). All get
the same config, the same weights (loaded from one transformers state dict), the same batch
and the same AdamW (``fused=True`` by default: on CPU the fused kernel is ~8x faster than the
per-tensor loop that is torch's CPU default, which would otherwise add ~0.5 s per step at
the large shape), and run the same plain loop: forward, sum of token cross-entropy divided by
the token count, backward, AdamW step, zero_grad. After warm-up (two steps at least for the
compiled ones: the first compiles), timed steps run one by one in turn, the order rotated
every repeat (and reversed every other round), so that background load on a shared machine
hits all alike. ``ratios`` has each meshforge variant against transformers eager and
meshforge compiled against transformers compiled:

* ``median_of_pairs``: median over repeats of the two steps' time ratio within a round,
  the figure least disturbed by bursts of load from other processes;
* ``total``: total tokens/s over all timed steps;
* ``fastest_steps``: fastest step of each;
* ``cpu_time``: process CPU time (all threads) over the timed steps, less affected by
  being descheduled when the machine is oversubscribed.

``first_loss`` is every contender's first step (same weights, same batch: equal to the
printed digits). ``compile_time`` (``compile_time.py``; ``--no-compile-time`` skips it) is
each compiled variant's first step minus its steady step, cold (a fresh
``TORCHINDUCTOR_CACHE_DIR``) and in a second process with that cache warm. ``cpu`` is the
CPU's model name.

Model FLOPs per token = 6 * N_matmul + 12 * L * H * D * S, where N_matmul counts
every weight that takes part in a matmul (all projections and the LM head, a tied
head included; not the embedding lookup and not norm weights) and the second term
is QK^T and PV (2 * 2 * S * H * D per token and layer forward, x3 with backward,
causal half not discounted). ``share_of_peak`` divides the median step's GFLOP/s
by the median of fp32 ``torch.mm`` rates (2048^3) sampled between the timed pairs,
so both are measured under the same load; ``share_of_peak_best`` uses the fastest
step and the best sample. Peak RSS is measured per model in a child process that
builds only that model and trains two steps (``--no-rss`` skips it).

For the MoE families the FLOPs count the active parameters (``num_experts_per_tok``
routed experts per MoE layer, each model's ``flops_per_token``); transformers runs
its default experts implementation (reported as ``hf_experts_implementation``).

Also ``minimax_m2`` (MoE shape ``small``, every layer sparse) against transformers, and
``step3p5`` (its tiny flavor), which transformers does not have: meshforge's own tokens/s and
share of the mm peak only.

Run: ``python benchmarks/step_throughput.py [--family qwen3|qwen3_moe|deepseek_v3|minimax_m2|step3p5|all]
[--quick] [--shape small|large|all] [--breakdown] [--eager-only | --variants ...]``. Prints one JSON line per
(family, shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compile_time  # noqa: E402
import torch  # noqa: E402
from _harness import (  # noqa: E402
    FAMILY_NAMES,
    Runner,
    build_hf,
    cpu_name,
    emit,
    families,
    measure_mm_peak,
    median_high,
    mm_rate,
    pair_median,
    rss_mb,
    shape_args,
    shape_batch,
    utc_now,
)
from step_variants import COMPILED_VARIANTS, VARIANTS, step_breakdown  # noqa: E402


def rss_child(model_name: str, family_name: str, shape: str, adamw: str) -> None:
    """Run in a fresh process: build one model, train 2 steps, print its peak RSS (MB)."""
    import transformers  # noqa: F401  (both children pay the same import, so baselines match)

    family = families()[family_name]
    spec = family.shapes[shape]
    args = shape_args(family, spec)
    before = rss_mb()
    model = build_hf(family, args) if model_name == "transformers" else family.model_cls(args).train()
    runner = Runner(
        model_name, model, shape_batch(spec, args.vocab_size), model_name == "transformers", adamw
    )
    for _ in range(2):
        runner.step()
    print(json.dumps({"peak_rss_mb": round(rss_mb(), 1), "rss_before_model_mb": round(before, 1)}))


def measure_rss(family: str, shape: str, adamw: str, threads: int) -> dict[str, float]:
    """Peak RSS of a 2-step run of each model alone, each in its own process.

    Returns each peak and each peak minus the RSS just before the model was built
    (torch and transformers imported).
    """
    out = {}
    for name in ("transformers", "meshforge"):
        cmd = [sys.executable, __file__, "--rss-child", name, "--family", family, "--shape", shape]
        cmd += ["--adamw", adamw]
        proc = subprocess.run([*cmd, "--threads", str(threads)], capture_output=True, text=True, check=True)
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        out[name] = child["peak_rss_mb"]
        out[f"{name}_over_baseline"] = round(child["peak_rss_mb"] - child["rss_before_model_mb"], 1)
    return out


def run_shape(
    family_name: str,
    name: str,
    spec: dict,
    *,
    warmup: int,
    steps: int,
    repeats: int,
    peak: float,
    adamw: str,
    breakdown: bool = False,
    variants: tuple[str, ...] = tuple(VARIANTS),
) -> dict:
    family = families()[family_name]
    args = shape_args(family, spec)
    hf = build_hf(family, args)
    state = hf.state_dict()
    batch = shape_batch(spec, args.vocab_size)
    runners: list[Runner] = []
    models: dict[str, torch.nn.Module] = {}
    for variant in variants:
        is_hf, make = VARIANTS[variant]
        if is_hf:
            model = hf if not any(VARIANTS[r.name][0] for r in runners) else build_hf(family, args)
        else:
            model = family.model_cls(args).train()
        model.load_state_dict(state, strict=True)
        models[variant] = model
        runners.append(Runner(variant, model, batch, is_hf, adamw, make(model)))
    # Compiled variants compile forward and backward in the first step; the second is steady.
    # Every contender gets as many warm-up steps, so that the last losses are comparable too.
    warmup = max(warmup, 2) if any(r.fns.compiled for r in runners) else warmup
    for r in runners:
        r.warmup(warmup)
    mm_a, mm_b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak_samples = [peak]
    for i in range(repeats):
        # Rotate the order every repeat (reversed on odd rounds) so that every contender
        # runs next to every other one and no position is favoured.
        k = i % len(runners)
        order = runners[k:] + runners[:k]
        for r in order if (i // len(runners)) % 2 == 0 else order[::-1]:
            r.timed_block(steps)
        # A peak sample under the same background load as this round of blocks.
        peak_samples.append(mm_rate(mm_a, mm_b))
    by_name = {r.name: r for r in runners}
    reference = runners[0]
    ours = next(m for v, m in models.items() if not VARIANTS[v][0])
    flops_per_token = ours.flops_per_token(spec["seq"])
    tokens_per_block = steps * batch["input_ids"].numel()
    gflops = {r.name: flops_per_token * r.tokens_per_s / 1e9 for r in runners}
    # Median block rate over median peak sample: both sampled under the same load.
    median_gflops = {
        r.name: flops_per_token * tokens_per_block / median_high(r.block_seconds) / 1e9 for r in runners
    }
    best_gflops = {r.name: flops_per_token * tokens_per_block / min(r.block_seconds) / 1e9 for r in runners}
    peak_median, peak_best = median_high(peak_samples), max(peak_samples)
    mesh = [r for r in runners if not r.is_hf]
    # Each meshforge variant against transformers eager (and compiled against compiled):
    # median over repeats of the two blocks' time ratio, the figure least moved by load bursts.
    ratios: dict[str, dict[str, float]] = {}
    for r in mesh:
        ratios[f"{r.name}/{reference.name}"] = {
            "median_of_pairs": round(pair_median(reference, r), 3),
            "total": round(r.tokens_per_s / reference.tokens_per_s, 3),
            "fastest_steps": round(min(reference.block_seconds) / min(r.block_seconds), 3),
            "cpu_time": round(reference.cpu_seconds / r.cpu_seconds, 3),
        }
    if "transformers_compiled" in by_name and "meshforge_compiled" in by_name:
        theirs, mine = by_name["transformers_compiled"], by_name["meshforge_compiled"]
        ratios["meshforge_compiled/transformers_compiled"] = {
            "median_of_pairs": round(pair_median(theirs, mine), 3),
            "total": round(mine.tokens_per_s / theirs.tokens_per_s, 3),
            "fastest_steps": round(min(theirs.block_seconds) / min(mine.block_seconds), 3),
            "cpu_time": round(theirs.cpu_seconds / mine.cpu_seconds, 3),
        }
    if "transformers_compiled" in by_name:
        theirs = by_name["transformers_compiled"]
        ratios["transformers_compiled/transformers_eager"] = {
            "median_of_pairs": round(pair_median(reference, theirs), 3)
        }
    result = {
        "family": family_name,
        "shape": name,
        "batch": spec["batch"],
        "seq": spec["seq"],
        "hidden": args.hidden_size,
        "layers": args.num_hidden_layers,
        "vocab": args.vocab_size,
        "params": ours.num_params(),
        "active_params": ours.num_params(active=True) if hasattr(ours, "moe_layers") else ours.num_params(),
        "tokens_per_s": {r.name: round(r.tokens_per_s, 1) for r in runners},
        "tokens_per_s_median_step": {
            r.name: round(tokens_per_block / median_high(r.block_seconds), 1) for r in runners
        },
        "ratios": ratios,
        "adamw": adamw,
        "gflops": {k: round(v, 2) for k, v in gflops.items()},
        "share_of_peak": {k: round(v / peak_median, 3) for k, v in median_gflops.items()},
        "share_of_peak_best": {k: round(v / peak_best, 3) for k, v in best_gflops.items()},
        "mm_peak_gflops": {"median": round(peak_median, 1), "best": round(peak_best, 1)},
        "target_ratio": spec["target_ratio"],
        "target_share_of_peak": spec["target_peak"],
        # Same data, weights and optimizer: the first step's losses agree to the printed digits.
        "first_loss": {r.name: round(r.first_loss, 5) for r in runners},
        "last_loss": {r.name: round(r.losses[-1], 5) for r in runners},
        "peak_rss_mb_this_process": round(rss_mb(), 1),
        "timed_steps_each": steps * repeats,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "date": utc_now(),
    }
    experts_impl = getattr(hf.config, "_experts_implementation", None)
    if hasattr(ours, "moe_layers") and experts_impl is not None:
        result["hf_experts_implementation"] = experts_impl
    if breakdown:
        result["ms_per_step_by_kernel"] = {r.name: step_breakdown(r) for r in runners}
    return result


# Families transformers has no model for, measured by `alone_throughput.py` (meshforge alone).
ALONE_FAMILIES = ("step3p5",)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    parser.add_argument(
        "--family",
        choices=[*FAMILY_NAMES, *ALONE_FAMILIES, "mamba3", "all"],
        default="qwen3",
        help="model family (qwen3 is dense; qwen3_moe and deepseek_v3 have one MoE shape, small; "
        "mamba3: chunked scan vs step recurrence, mamba3_throughput.py)",
    )
    parser.add_argument("--shape", choices=["small", "large", "mimo", "all"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per model")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per model")
    parser.add_argument(
        "--adamw",
        choices=["fused", "foreach", "loop"],
        default="fused",
        help="AdamW implementation for both models (fused is ~8x faster than the others on CPU)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also profile one step of each: ms by kind of kernel"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="contenders (transformers_eager, the ratios' reference, is always run)",
    )
    parser.add_argument(
        "--eager-only", action="store_true", help="transformers_eager and meshforge_eager only"
    )
    parser.add_argument(
        "--no-compile-time",
        action="store_true",
        help="skip the cold/warm-cache compile-time child runs of the compiled variants",
    )
    parser.add_argument("--no-rss", action="store_true", help="skip the per-model peak-RSS child runs")
    parser.add_argument("--rss-child", choices=["transformers", "meshforge"], help=argparse.SUPPRESS)
    parser.add_argument("--compile-child", choices=list(COMPILED_VARIANTS), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    if opts.rss_child:
        rss_child(opts.rss_child, opts.family, opts.shape, opts.adamw)
        return
    if opts.compile_child:
        compile_time.child_main(opts.compile_child, opts.family, opts.shape, opts.adamw)
        return
    chosen = ["transformers_eager", "meshforge_eager"] if opts.eager_only else opts.variants
    variants = tuple(v for v in VARIANTS if v == "transformers_eager" or v in chosen)
    if opts.family == "mamba3":
        # No transformers class exists: the chunked scan against the step recurrence.
        from mamba3_throughput import main as mamba3_main

        if opts.shape not in ("all", "small", "mimo"):
            parser.error(f"--shape {opts.shape}: not defined for --family mamba3 (small, mimo)")
        mamba3_main(
            shape=opts.shape,
            quick=opts.quick,
            warmup=opts.warmup,
            steps=opts.steps,
            repeats=opts.repeats,
            adamw=opts.adamw,
        )
        return
    warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 3)
    # One step per block: alternating every step keeps both models under the same load.
    steps = opts.steps if opts.steps is not None else 1
    repeats = opts.repeats if opts.repeats is not None else (2 if opts.quick else 16)
    if opts.family in ALONE_FAMILIES:
        from alone_throughput import ALONE, run_alone

        peak = measure_mm_peak(trials=1 if opts.quick else 3)
        for name, spec in ALONE[opts.family].items():
            if opts.shape in ("all", name):
                kwargs = dict(warmup=warmup, repeats=repeats, peak=peak, adamw=opts.adamw)
                emit(run_alone(opts.family, name, spec, **kwargs))
        return
    names = list(FAMILY_NAMES) if opts.family == "all" else [opts.family]
    cases = [
        (fam, shape) for fam in names for shape in families()[fam].shapes if opts.shape in ("all", shape)
    ]
    if not cases:
        parser.error(f"--shape {opts.shape}: not defined for --family {opts.family} (MoE families: small)")
    peak = measure_mm_peak(trials=1 if opts.quick else 3)
    for fam, name in cases:
        result = run_shape(
            fam,
            name,
            families()[fam].shapes[name],
            warmup=warmup,
            steps=steps,
            repeats=repeats,
            peak=peak,
            adamw=opts.adamw,
            breakdown=opts.breakdown,
            variants=variants,
        )
        # The timed figures first (stderr), in case the compile-time runs below are cut short.
        emit(result, file=sys.stderr)
        compiled = tuple(v for v in variants if v in COMPILED_VARIANTS)
        if compiled and not opts.no_compile_time:
            result["compile_time"] = compile_time.measure_compile_time(
                compiled, fam, name, opts.adamw, opts.threads
            )
        if not opts.no_rss:
            result["peak_rss_mb"] = measure_rss(fam, name, opts.adamw, opts.threads)
        emit(result)


if __name__ == "__main__":
    main()
