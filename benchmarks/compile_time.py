"""Compile time of the compiled variants of ``step_throughput.py``, cold and with a warm cache.

Each variant is measured in two child processes that share one fresh
``TORCHINDUCTOR_CACHE_DIR``: the first compiles from nothing (cold), the second finds
inductor's and the autograd cache's artefacts of the first on disk (warm), as a second run
of the same training job would. A child builds the model, times its first three steps and
reports ``first_step_s`` and the median of the next two (``steady_step_s``);
``compile_s`` is their difference. A fresh directory per variant keeps one variant's cache
from warming another's (``meshforge_default`` and ``meshforge_compiled`` compile the same
graphs today).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 3
CHILD_TIMEOUT_S = 900


def child_main(variant: str, family_name: str, shape: str, adamw: str) -> None:
    """In a fresh process: build ``variant``'s model, time its first steps, print one JSON line."""
    from _harness import Runner, build_hf, emit, families, shape_args, shape_batch
    from step_variants import VARIANTS

    family = families()[family_name]
    spec = family.shapes[shape]
    args = shape_args(family, spec)
    is_hf, make = VARIANTS[variant]
    model = build_hf(family, args) if is_hf else family.model_cls(args).train()
    runner = Runner(variant, model, shape_batch(spec, args.vocab_size), is_hf, adamw, make(model))
    seconds = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        runner.step()
        seconds.append(time.perf_counter() - t0)
    steady = sorted(seconds[1:])[len(seconds[1:]) // 2]
    emit({"first_step_s": round(seconds[0], 2), "steady_step_s": round(steady, 3)})


def _child(variant: str, family: str, shape: str, adamw: str, threads: int, cache: Path) -> dict:
    script = Path(__file__).with_name("step_throughput.py")
    cmd = [sys.executable, str(script), "--compile-child", variant, "--family", family, "--shape", shape]
    cmd += ["--adamw", adamw, "--threads", str(threads)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"failed": f"no result within {CHILD_TIMEOUT_S} s"}
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"failed": "\n".join(tail)}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["compile_s"] = round(out["first_step_s"] - out["steady_step_s"], 2)
    return out


def measure_compile_time(
    variants: tuple[str, ...], family: str, shape: str, adamw: str, threads: int
) -> dict[str, dict[str, dict]]:
    """Variant -> {"cold": ..., "warm": ...}, each with first/steady step seconds and ``compile_s``."""
    results: dict[str, dict[str, dict]] = {}
    for variant in variants:
        cache = Path(tempfile.mkdtemp(prefix=f"inductor-{variant}-"))
        try:
            results[variant] = {
                run: _child(variant, family, shape, adamw, threads, cache) for run in ("cold", "warm")
            }
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return results


__all__ = ["child_main", "measure_compile_time"]
