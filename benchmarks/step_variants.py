"""The contenders of ``step_throughput.py``: how each one runs forward and loss, and its step loop.

Every variant is a :class:`StepFns` built on a model that already holds the shared weights:
``forward(input_ids)`` returns what ``loss(output, labels)`` turns into the summed token
cross-entropy (logits today; a fused linear + cross-entropy would return hidden states and
close over the LM head in ``loss``). The step loop around them (divide by the token count,
backward, AdamW, zero_grad) is the same for all, in ``_harness.Runner``.

* ``meshforge_eager``: the model as built, ``F.cross_entropy`` on the logits.
* ``meshforge_compiled``: ``kernels.compile: true`` through meshforge's own code: every
  decoder layer compiled (``apply_compile``) and the run's loss (``KernelOptions.lm_loss``)
  with compiled steps.
* ``meshforge_default``: what a long run gets when ``kernels`` is not written (the ``auto``
  rules); see :func:`meshforge_default`.
* ``transformers_eager``: transformers' ``*ForCausalLM`` as built, the eager loss.
* ``transformers_compiled``: ``torch.compile(model)`` (the whole model, as transformers
  documents it) and the same compiled loss as meshforge's, so the compiled-vs-compiled
  ratio compares the models, not the loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import torch
from _harness import Runner, StepFns, meshforge_eager, summed_cross_entropy, transformers_eager

_compiled_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def compiled_cross_entropy() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One ``torch.compile`` of :func:`summed_cross_entropy`, shared by every compiled variant."""
    global _compiled_loss
    if _compiled_loss is None:
        _compiled_loss = torch.compile(summed_cross_entropy)
    return _compiled_loss


# The benchmark measures the steady step of a long run: the run length the `auto` rule sees.
_LONG_RUN_STEPS = 100_000


def _meshforge(model: torch.nn.Module, compile_setting: bool | Literal["auto"]) -> StepFns:
    """``model`` set up by meshforge's own kernel rules, as a run with ``kernels.compile`` =
    ``compile_setting`` and the other ``kernels`` keys unwritten sets it up on the model's
    device and dtype.

    The decision, the compiled layers and the loss formulation (full logits, or the fused
    linear cross-entropy at large vocabularies; compiled steps when compiling) come from
    ``resolve_kernel_options`` / ``apply_compile`` / ``KernelOptions.lm_loss``.
    """
    from meshforge.models.common.compile import RunLength
    from meshforge.models.common.kernels import apply_compile, configure_model_kernels, resolve_kernel_options
    from meshforge.models.config import KernelsConfig
    from meshforge.monitor.throughput import model_flops_per_token

    head = model.get_submodule("lm_head")
    assert isinstance(head, torch.nn.Linear)
    run = RunLength(_LONG_RUN_STEPS, 2048, model_flops_per_token(model, 256))
    weight = next(model.parameters())
    options = resolve_kernel_options(
        KernelsConfig(compile=compile_setting),
        device=weight.device,
        compute_dtype=weight.dtype,
        warn=print,
        vocab_size=int(head.weight.shape[0]),
        run=run,
    )
    options = configure_model_kernels(model, options, family=type(model).__name__)
    if options.compile:
        apply_compile(model, backend=options.compile_backend)
    loss = options.lm_loss()
    if loss.needs_hidden:
        return StepFns(
            lambda ids: model(ids, return_hidden=True), lambda h, y: loss(h, y, head.weight), options.compile
        )
    return StepFns(lambda ids: model(ids), loss, options.compile)


def meshforge_compiled(model: torch.nn.Module) -> StepFns:
    """``kernels.compile: true``: each decoder layer compiled in place (parameter names kept),
    the loss steps compiled, the loss formulation by meshforge's rule for the vocabulary."""
    return _meshforge(model, True)


def meshforge_default(model: torch.nn.Module) -> StepFns:
    """What meshforge runs when ``kernels`` is not written (``kernels.compile: auto``,
    ``fused_linear_cross_entropy: auto``) for a long run on this CPU."""
    return _meshforge(model, "auto")


def transformers_compiled(model: torch.nn.Module) -> StepFns:
    compiled = torch.compile(model)
    return StepFns(
        lambda ids: compiled(input_ids=ids, use_cache=False).logits, compiled_cross_entropy(), compiled=True
    )


# Variant name -> (is a transformers model, how to run it). The first is the ratios' reference.
VARIANTS: dict[str, tuple[bool, Callable[[torch.nn.Module], StepFns]]] = {
    "transformers_eager": (True, transformers_eager),
    "transformers_compiled": (True, transformers_compiled),
    "meshforge_eager": (False, meshforge_eager),
    "meshforge_compiled": (False, meshforge_compiled),
    "meshforge_default": (False, meshforge_default),
}
COMPILED_VARIANTS = ("transformers_compiled", "meshforge_compiled", "meshforge_default")


_MODEL_KERNELS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("attention", ("scaled_dot_product",)),
)


def step_breakdown(runner: Runner, steps: int = 2) -> dict[str, float]:
    """Milliseconds per step: matmul / attention / loss / optimizer / other.

    The step is split where the loss starts: the model's output is detached, the loss runs
    forward and backward on it alone (timed: ``loss``, compiled kernels included), then the
    model's backward continues from the output's gradient. ``optimizer`` is the timed AdamW
    step and zero_grad. In the model's part, ``matmul`` and ``attention`` are the self CPU
    time of those kernels under torch.profiler (inductor calls the same aten matmul and SDPA
    kernels), and ``other`` is the rest of that part: elementwise work, norms, RoPE, fused
    inductor kernels, Python and autograd overhead.
    """
    totals = {"matmul": 0.0, "attention": 0.0, "loss": 0.0, "optimizer": 0.0, "model": 0.0}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = runner.fns.forward(runner.input_ids)
            t1 = time.perf_counter()
            detached = out.detach().requires_grad_()
            loss = runner.fns.loss(detached, runner.labels) / runner.num_tokens
            loss.backward()
            t2 = time.perf_counter()
            out.backward(detached.grad)
            t3 = time.perf_counter()
            runner.opt.step()
            runner.opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            totals["model"] += (t1 - t0) + (t3 - t2)
            totals["loss"] += t2 - t1
            totals["optimizer"] += t4 - t3
    for event in prof.key_averages():
        key = event.key.lower()
        kind = next((name for name, needles in _MODEL_KERNELS if any(n in key for n in needles)), None)
        if kind is not None:
            totals[kind] += event.self_cpu_time_total / 1e6
    model = totals.pop("model")
    totals["other"] = max(0.0, model - totals["matmul"] - totals["attention"])
    return {k: round(v * 1e3 / steps, 1) for k, v in totals.items()}


__all__ = [
    "COMPILED_VARIANTS",
    "VARIANTS",
    "compiled_cross_entropy",
    "meshforge_compiled",
    "meshforge_default",
    "step_breakdown",
    "transformers_compiled",
]
