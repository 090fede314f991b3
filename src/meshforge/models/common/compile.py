"""``kernels.compile``: whether a run compiles (the ``auto`` rule) and how (per layer, with a fallback).

Regional compilation, torchtitan's way: each decoder layer is one ``torch.compile`` region,
compiled before ``fully_shard`` so FSDP's hooks stay outside the graphs, and identical layers
share one graph (dynamo caches by code object). The loss steps are compiled separately
(:mod:`meshforge.loss.lm`).

The ``auto`` rule (:func:`decide_compile`):

* CUDA/NPU: on. Kernel launches and elementwise chains are what compile removes there, and
  its cost (tens of seconds) is small next to any real run.
* CPU: on only when the run's estimated eager length reaches :data:`CPU_PAYBACK_SECONDS`.
  Measured on this project's 2-core Xeon (``benchmarks/step_throughput.py``, small Qwen3):
  a cold compile of the layers and the loss takes 33 s (3 s with a warm inductor cache) and
  the compiled step is 1.27x the eager one (0.54 against 0.68 s), so a cold compile pays back
  after about 160 s of eager training; at the large shape the gain is 1.1x on steps ten
  times longer. The threshold keeps a margin of about 4x for bigger models, whose compile
  takes longer, and for the estimate's error. The estimate is ``steps x tokens per step x FLOPs per token / (0.5 x a measured fp32 matmul
  rate)`` (training steps reach about half the matmul peak here). Short runs (tests, the
  demo, smoke runs) therefore stay eager unless they ask for ``true``.

  The matmul probe is skipped when the work alone decides: the rate it measures lies between
  :data:`SLOWEST_MATMUL_RATE` and :data:`FASTEST_MATMUL_RATE`, so a run that even the slowest
  machine finishes under the threshold stays eager, and one that even the fastest cannot is
  compiled, without measuring (most test runs are the first kind).

A layer that fails to compile (dynamo or the backend raising while tracing or generating
code) runs eagerly from then on, and so do the other layers of its class, with one warning
naming the layer and the reason: never a silent slowdown, never a crash of a run that eager
mode can train. The backward graph is generated together with the forward
(``force_non_lazy_backward_lowering``) so that its failures surface where they can be caught,
and scalars read off tensors (the MoE experts' token counts) are traced rather than breaking
the graph (``capture_scalar_outputs``); both are process-wide dynamo settings, set when a run
compiles.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

CPU_PAYBACK_SECONDS = 600.0
_STEP_SHARE_OF_MATMUL_PEAK = 0.5
# The bounds of a plausible probe result (fp32 FLOP/s), wide enough that they never decide a
# run the probe would decide otherwise. Slowest: 1 GFLOP/s, one core without vector units
# doing one multiply-add a cycle at 500 MHz (this project's 2-core machines measure 67 to 320
# GFLOP/s). Fastest: 100 TFLOP/s, above the fp32 peak of any CPU server (two 192-core
# AVX-512 sockets peak near 55 at their 2.25 GHz base clock, under 100 at full boost); a
# 512 x 512 product reaches only a fraction of a peak.
SLOWEST_MATMUL_RATE = 1e9
FASTEST_MATMUL_RATE = 1e14


@dataclass(frozen=True)
class CompileDecision:
    """Whether the run compiles, and the sentence the start-up log prints about it."""

    on: bool
    reason: str


@dataclass(frozen=True)
class RunLength:
    """What the ``auto`` rule needs to know of a run: its steps and work per step.

    Attributes:
        steps: Optimizer steps, or None when the data decides (``training.epochs``).
        tokens_per_step: Tokens in one global batch on this rank's share of the work.
        flops_per_token: Training FLOPs per token (forward + backward), or None if unknown.
    """

    steps: int | None
    tokens_per_step: int
    flops_per_token: float | None


def measure_matmul_rate(size: int = 512, repeats: int = 3) -> float:
    """FLOP/s of this process's fp32 ``torch.mm`` (best of ``repeats``; about 0.05 s on 2 cores)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def decide_compile(
    setting: bool | Literal["auto"],
    *,
    device_type: str,
    run: RunLength,
    matmul_rate: Callable[[], float] = measure_matmul_rate,
) -> CompileDecision:
    """Apply the ``auto`` rule of the module docstring (``true``/``false`` are taken as they are)."""
    if setting is True:
        return CompileDecision(True, "kernels.compile: true")
    if setting is False:
        return CompileDecision(False, "kernels.compile: false")
    if device_type != "cpu":
        return CompileDecision(True, f"kernels.compile: auto -> on ({device_type})")
    if run.steps is None:
        return CompileDecision(
            False,
            "kernels.compile: auto -> off (cpu; the run length depends on the data: set true to compile)",
        )
    if run.flops_per_token is None:
        return CompileDecision(
            False,
            "kernels.compile: auto -> off (cpu; no FLOP count for this model to estimate the run length)",
        )
    work = run.steps * run.tokens_per_step * run.flops_per_token
    payback = f"compiling pays back from about {_duration(CPU_PAYBACK_SECONDS)}"
    longest = work / (SLOWEST_MATMUL_RATE * _STEP_SHARE_OF_MATMUL_PEAK)
    if longest < CPU_PAYBACK_SECONDS:
        return CompileDecision(
            False,
            f"kernels.compile: auto -> off (cpu; the run is estimated at {_duration(max(1.0, longest))} "
            f"eager at most, even at {SLOWEST_MATMUL_RATE / 1e9:g} GFLOP/s; {payback})",
        )
    shortest = work / (FASTEST_MATMUL_RATE * _STEP_SHARE_OF_MATMUL_PEAK)
    if shortest >= CPU_PAYBACK_SECONDS:
        return CompileDecision(
            True,
            f"kernels.compile: auto -> on (cpu; the run is estimated at {_duration(shortest)} eager "
            f"at least, even at {FASTEST_MATMUL_RATE / 1e12:g} TFLOP/s; {payback})",
        )
    seconds = work / (matmul_rate() * _STEP_SHARE_OF_MATMUL_PEAK)
    verdict = "on" if seconds >= CPU_PAYBACK_SECONDS else "off"
    return CompileDecision(
        verdict == "on",
        f"kernels.compile: auto -> {verdict} (cpu; the run is estimated at {_duration(seconds)} eager, {payback})",
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` of every decoder layer (``model.model.layers``; a pipeline
    stage keeps a ModuleDict keyed by the global layer index)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
        raise ValueError(
            f"kernels.compile: {type(model).__name__} has no model.layers to compile; set it to false"
        )
    items = (
        layers.items() if isinstance(layers, nn.ModuleDict) else ((str(i), m) for i, m in enumerate(layers))
    )
    return [(f"model.layers.{key}", layer) for key, layer in items]


@dataclass
class _FallbackRegistry:
    """Layer classes that failed to compile in this model, so the rest of the class goes eager too."""

    warn: Callable[[str], None]
    failed: set[str] = field(default_factory=set)
    layers: dict[str, list[nn.Module]] = field(default_factory=dict)

    def fall_back(self, name: str, layer: nn.Module, exc: BaseException) -> None:
        kind = type(layer).__name__
        if kind in self.failed:
            return
        self.failed.add(kind)
        for other in self.layers.get(kind, []):
            other._compiled_call_impl = None
        self.warn(
            f"warning: kernels.compile: {name} ({kind}) failed to compile and runs eagerly, "
            f"with every other {kind}: {_reason(exc)}"
        )


def _reason(exc: BaseException) -> str:
    """``Type: first line`` of the error, with the backend's own error when dynamo wraps one."""
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    if isinstance(inner, BaseException):
        text += f" ({type(inner).__name__}: {_first_line(inner)})"
    return text[:400]


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


class _GuardedCompiledCall:
    """A layer's compiled call that falls back to the eager call when compiling fails."""

    def __init__(self, layer: nn.Module, name: str, backend: str, registry: _FallbackRegistry) -> None:
        self.layer, self.name, self.registry = layer, name, registry
        self.eager = layer._call_impl
        self.compiled = torch.compile(self.eager, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self.compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            # A real error in the layer raises again here, eagerly, and the run stops on it.
            out = self.eager(*args, **kwargs)
            self.registry.fall_back(self.name, self.layer, exc)
            return out


def apply_compile(
    model: nn.Module, *, backend: str = "inductor", warn: Callable[[str], None] = print
) -> list[str]:
    """Compile every decoder layer of ``model`` in place, before FSDP; returns the layer names.

    The layer stays the same module with the same parameter names (the compiled call is
    installed where ``nn.Module.compile`` puts it), so checkpoints, hooks and module patterns
    do not change.

    Raises:
        ValueError: The model has no ``model.layers``.
    """
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    layers = decoder_layers(model)
    functorch_config.force_non_lazy_backward_lowering = True
    # The MoE per-expert loop slices by expert counts read off a tensor: traced as unbacked
    # sizes instead of breaking the graph.
    dynamo_config.capture_scalar_outputs = True
    registry = _FallbackRegistry(warn)
    for name, layer in layers:
        registry.layers.setdefault(type(layer).__name__, []).append(layer)
        layer._compiled_call_impl = _GuardedCompiledCall(layer, name, backend, registry)
    return [name for name, _ in layers]


__all__ = [
    "CPU_PAYBACK_SECONDS",
    "FASTEST_MATMUL_RATE",
    "SLOWEST_MATMUL_RATE",
    "CompileDecision",
    "RunLength",
    "apply_compile",
    "decide_compile",
    "decoder_layers",
    "measure_matmul_rate",
]
