"""``kernels.compile``: whether a run compiles (the ``auto`` rule) and how (per layer, with a fallback).

Regional compilation, torchtitan's way: each decoder layer is one ``torch.compile`` region,
compiled before ``fully_shard`` so FSDP's hooks stay outside the graphs, and identical layers
share one graph (dynamo caches by code object). The loss steps are compiled separately
(:mod:`meshforge.loss.lm`).

The ``auto`` rule (:func:`decide_compile`):

* CUDA/NPU: on. Kernel launches and elementwise chains are what compile removes there, and
  its cost (tens of seconds) is small next to any real run.
* CPU: on only when the eager length of the steps still to run, estimated at a fixed rate,
  reaches :data:`CPU_PAYBACK_SECONDS`. Measured on this project's 2-core Xeon
  (``benchmarks/step_throughput.py``, small Qwen3): a cold compile of the layers and the loss
  takes 33 s (3 s with a warm inductor cache) and the compiled step is 1.27x the eager one
  (0.54 against 0.68 s), so a cold compile pays back after about 160 s of eager training; at
  the large shape the gain is 1.1x on steps ten times longer. The threshold keeps a margin of
  about 4x for bigger models, whose compile takes longer, and for the estimate's error. The
  estimate is ``steps left x tokens per step on this rank x FLOPs per token /``
  :data:`CPU_TRAINING_FLOPS`: a fixed rate rather than a measured one, so that one command
  decides the same way on every machine of a kind, however busy it is. The rate is the demo's
  eager training rate on the project's quiet 2-core Xeon (1,541 tokens/s x 3.3e7 FLOPs per
  token = 51 GFLOP/s): the demo (400 steps, 9 minutes) and shorter runs (tests, smoke runs)
  stay eager unless they ask for ``true``, and a resumed run counts only the steps it has left.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

CPU_PAYBACK_SECONDS = 600.0
# Training FLOP/s of one CPU process for the estimate (see the module docstring).
CPU_TRAINING_FLOPS = 5e10
# A cold inductor compile of one decoder-layer graph, forward and backward, with its share of the
# loss's: 33 s for the small Qwen3's one layer graph and loss on the 2-core machine.
COLD_COMPILE_SECONDS_PER_GRAPH = 30.0


@dataclass(frozen=True)
class CompileDecision:
    """Whether the run compiles, and the sentence the start-up log prints about it."""

    on: bool
    reason: str


@dataclass(frozen=True)
class RunLength:
    """What the ``auto`` rule needs to know of a run: its steps and work per step.

    Attributes:
        steps: Optimizer steps still to run (after a resume: those left), or None when the data
            decides (``training.epochs``).
        tokens_per_step: Tokens in one global batch on this rank's share of the work.
        flops_per_token: Training FLOPs per token (forward + backward), or None if unknown.
    """

    steps: int | None
    tokens_per_step: int
    flops_per_token: float | None


def decide_compile(setting: bool | Literal["auto"], *, device_type: str, run: RunLength) -> CompileDecision:
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
    seconds = run.steps * run.tokens_per_step * run.flops_per_token / CPU_TRAINING_FLOPS
    verdict = "on" if seconds >= CPU_PAYBACK_SECONDS else "off"
    return CompileDecision(
        verdict == "on",
        f"kernels.compile: auto -> {verdict} (cpu; {run.steps} step{'' if run.steps == 1 else 's'} to run, "
        f"estimated at {_duration(max(1.0, seconds))} eager at {CPU_TRAINING_FLOPS / 1e9:g} GFLOP/s; "
        f"compiling pays back from about {_duration(CPU_PAYBACK_SECONDS)})",
    )


def compile_estimate(graphs: int, backend: str) -> str:
    """The start-up line's guess of the first step's compile time, for ``graphs`` distinct layers.

    Only inductor generates code; the other backends (``aot_eager``, ``eager``) trace in seconds.
    """
    if backend != "inductor":
        return "a few seconds"
    seconds = graphs * COLD_COMPILE_SECONDS_PER_GRAPH
    return f"about {_duration(seconds)} cold, a few seconds with a warm inductor cache"


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
    model: nn.Module,
    *,
    backend: str = "inductor",
    warn: Callable[[str], None] = print,
    log: Callable[[str], None] = lambda line: None,
) -> list[str]:
    """Compile every decoder layer of ``model`` in place, before FSDP; returns the layer names.

    ``log`` receives one line before anything compiles: how many graphs the first step compiles
    and about how long that takes.

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
    graphs = len(registry.layers)
    log(
        f"kernels.compile: compiling decoder layers ({len(layers)} layer(s), {graphs} graph(s), backend "
        f"{backend}) at the first step: {compile_estimate(graphs, backend)}"
    )
    return [name for name, _ in layers]


__all__ = [
    "COLD_COMPILE_SECONDS_PER_GRAPH",
    "CPU_PAYBACK_SECONDS",
    "CPU_TRAINING_FLOPS",
    "CompileDecision",
    "RunLength",
    "apply_compile",
    "compile_estimate",
    "decide_compile",
    "decoder_layers",
]
