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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from meshforge.loss.cross_entropy import (
    IGNORE_INDEX,
    _as_dtensor,
    chunk_loss_and_grad,
    chunk_loss_sum,
    chunked_cross_entropy_sum,
    cross_entropy_sum,
    fused_linear_cross_entropy_sum,
)

LossMode = Literal["logits", "chunked", "fused"]

# The fused loss's default chunk: about 64M logits (256 MiB in float32) per chunk, between
# 512 and 8192 tokens: 512 at vocabulary 151,936, 2,097 at 32,000.
_FUSED_LOGITS_PER_CHUNK = 1 << 26
_FUSED_MIN_CHUNK, _FUSED_MAX_CHUNK = 512, 8192


def fused_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of the fused loss when ``kernels.chunk_loss_size`` does not set it."""
    return max(_FUSED_MIN_CHUNK, min(_FUSED_MAX_CHUNK, _FUSED_LOGITS_PER_CHUNK // max(1, vocab_size)))


def _plain_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass(frozen=True)
class _Steps:
    plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss: Callable[..., torch.Tensor]
    grad: Callable[..., tuple[torch.Tensor, torch.Tensor]]


_EAGER = _Steps(_plain_sum, chunk_loss_sum, chunk_loss_and_grad)


@functools.cache
def _compiled_steps(backend: str) -> _Steps:
    """Compiled copies of the loss steps, one set per backend in this process."""
    return _Steps(
        torch.compile(_plain_sum, backend=backend),
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

    def _steps(self) -> _Steps:
        return _compiled_steps(self.compile_backend) if self.compile_backend else _EAGER

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
            if _as_dtensor(output) is not None or _as_dtensor(labels) is not None or not self.compile_backend:
                return cross_entropy_sum(output, labels)
            return steps.plain(output, labels)
        if head_weight is None:
            raise ValueError(f"the {self.mode} loss applies the LM head itself: pass head_weight")
        assert self.chunk_size is not None
        if self.mode == "fused":
            return fused_linear_cross_entropy_sum(
                output,
                head_weight,
                labels,
                chunk_size=self.chunk_size,
                grad_step=steps.grad,
                loss_step=steps.loss,
            )
        return chunked_cross_entropy_sum(
            output, head_weight, labels, chunk_size=self.chunk_size, steps=(steps.loss, steps.grad)
        )


__all__ = ["LMLoss", "LossMode", "fused_chunk_size"]
