"""The language-model loss of a run: which of the three formulations, compiled or not.

* ``logits``: the model returns full logits and :func:`meshforge.loss.cross_entropy.cross_entropy_sum`
  takes them (loss parallelism included);
* ``chunked`` (``kernels.chunk_loss_size``): the model returns its normed hidden states and
  the head runs chunk by chunk, recomputing each chunk's logits in backward (the least memory);
* ``fused`` (``kernels.fused_linear_cross_entropy``): chunk by chunk as well, with the
  gradient taken in the forward, so each chunk's logits are computed once.

With ``kernels.compile`` on, the per-chunk steps (and the plain loss on local logits) are
``torch.compile``d: the float32 cast, log-sum-exp and ``softmax - one_hot`` of a chunk become
one kernel instead of four passes over ``[tokens, vocab]``. Compiled copies are made once per
backend and process, so every call site (trainer, pipeline last stage, MTP depths) shares
their graphs; a chunk of another length (the last one) costs one recompile with a dynamic size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from meshforge.loss.cross_entropy import (
    EAGER_STEPS,
    LossSteps,
    _as_dtensor,
    chunk_loss_and_grad,
    chunk_loss_sum,
    chunked_cross_entropy_sum,
    cross_entropy_sum,
    fused_linear_cross_entropy_sum,
    token_cross_entropy_sum,
)

LossMode = Literal["logits", "chunked", "fused"]

# The fused loss's default chunk: about 64M logits (256 MiB in float32) per chunk, between
# 512 and 8192 tokens: 512 at vocabulary 151,936, 2,097 at 32,000.
_FUSED_LOGITS_PER_CHUNK = 1 << 26
_FUSED_MIN_CHUNK, _FUSED_MAX_CHUNK = 512, 8192


def fused_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of the fused loss when ``kernels.chunk_loss_size`` does not set it."""
    return max(_FUSED_MIN_CHUNK, min(_FUSED_MAX_CHUNK, _FUSED_LOGITS_PER_CHUNK // max(1, vocab_size)))


@functools.cache
def _compiled_steps(backend: str) -> LossSteps:
    """Compiled copies of the loss steps, one set per backend in this process."""
    return LossSteps(
        torch.compile(token_cross_entropy_sum, backend=backend),
        torch.compile(chunk_loss_sum, backend=backend),
        torch.compile(chunk_loss_and_grad, backend=backend),
    )


@dataclass(frozen=True)
class LMLoss:
    """How a forward's output becomes the summed token cross-entropy of a micro-batch.

    Attributes:
        mode: ``logits``, ``chunked`` or ``fused`` (see the module docstring).
        chunk_size: Tokens per chunk (``chunked`` and ``fused``).
        compile_backend: The ``torch.compile`` backend of the loss steps, or None for eager.
    """

    mode: LossMode = "logits"
    chunk_size: int | None = None
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        if self.mode != "logits" and (self.chunk_size is None or self.chunk_size < 1):
            raise ValueError(f"kernels.chunk_loss_size: the {self.mode} loss needs a positive chunk size")

    @property
    def needs_hidden(self) -> bool:
        """The model returns normed hidden states (``return_hidden=True``) and the loss applies the head."""
        return self.mode != "logits"

    def describe(self) -> str:
        """One phrase for the start-up log and the memory plan."""
        compiled = ", compiled" if self.compile_backend else ""
        if self.mode == "logits":
            return f"full-logits loss{compiled}"
        name = "fused linear cross-entropy" if self.mode == "fused" else "chunked loss"
        return f"{name} ({self.chunk_size} tokens per chunk{compiled})"

    def _steps(self) -> LossSteps:
        return _compiled_steps(self.compile_backend) if self.compile_backend else EAGER_STEPS

    def __call__(
        self, output: torch.Tensor, labels: torch.Tensor, head_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The summed cross-entropy over valid labels (a float32 0-dim tensor).

        Args:
            output: Logits ``[B, S, V]`` (mode ``logits``) or normed hidden states ``[B, S, H]``.
            labels: ``[B, S]`` targets aligned with the positions, -100 ignored.
            head_weight: The LM head's weight ``[V, H]`` (hidden-state modes); read after the
                forward, when FSDP has it unsharded.
        """
        steps = self._steps()
        if self.mode == "logits":
            # DTensor logits (tensor parallelism) take the eager path, which gathers or splits them.
            if _as_dtensor(output) is not None or _as_dtensor(labels) is not None or not self.compile_backend:
                return cross_entropy_sum(output, labels)
            return steps.plain(output, labels)
        if head_weight is None:
            raise ValueError(f"the {self.mode} loss applies the LM head itself: pass head_weight")
        assert self.chunk_size is not None
        loss = fused_linear_cross_entropy_sum if self.mode == "fused" else chunked_cross_entropy_sum
        return loss(output, head_weight, labels, chunk_size=self.chunk_size, steps=steps)


def select_lm_loss(
    *, fused: bool, chunk_loss_size: int | None, vocab_size: int | None, compile_backend: str | None = None
) -> LMLoss:
    """The formulation a run of these settings trains with (the trainer's and the planner's).

    Args:
        fused: The fused linear cross-entropy is on (``kernels.fused_linear_cross_entropy``,
            decided by :func:`meshforge.models.common.kernels.fused_loss_on`).
        chunk_loss_size: ``kernels.chunk_loss_size``: the fused loss's chunk when it is on,
            else the recomputing chunked loss; None: the fused default chunk or full logits.
        vocab_size: The model's vocabulary (the fused loss's default chunk).
        compile_backend: The backend of compiled loss steps, or None for eager.
    """
    if fused:
        return LMLoss("fused", chunk_loss_size or fused_chunk_size(vocab_size or 0), compile_backend)
    if chunk_loss_size is not None:
        return LMLoss("chunked", chunk_loss_size, compile_backend)
    return LMLoss("logits", None, compile_backend)


__all__ = ["LMLoss", "LossMode", "fused_chunk_size", "select_lm_loss"]
