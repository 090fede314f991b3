"""Chunked micro-batches (MindSpeed `enable_chunk_batch`): run chosen modules on slices of the batch.

A matched module (by default each decoder layer) runs its forward `chunk_mbs` times, each time on
a contiguous slice of the micro-batch along `chunk_mbs_batch_dim`, and its outputs are joined
again. Rows never interact inside a decoder layer (attention, MLP, MoE routing and normalisation
are per row or per token), so the result is the same as one call; what changes is the size of
the temporaries a layer builds at once (attention scores, the MLP's widened activations, the
MoE dispatch buffers). Under FSDP the unit's parameters are gathered once for all chunks, since
the split happens inside the module's own forward.

Which inputs are split: the positional arguments at `chunk_mbs_arg_indexs`, the keyword
arguments named in `chunk_mbs_kwarg_names` (MindSpeed's defaults are transformers' decoder-layer
names), and every other tensor argument, or tuple of tensors, whose size along the batch dim is
the micro-batch's (meshforge's own layers take the RoPE tables, the mask and the token mask
positionally). Arguments with batch size 1 broadcast and go to every chunk whole. Objects that
describe the rows in some other form slice themselves: anything with a
``narrow_batch(dim, start, stop)`` method (:class:`~meshforge.parallel.context.CPMask`, the
context-parallel mask with the full rows' document ids) is replaced by what that returns for each
chunk's rows.

MoE layers leave per-forward routing statistics behind (`last_aux_stats`, `last_tokens_per_expert`);
they are sums over tokens, so the chunks' values are added up and the layer reports the same
statistics as one call would.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import torch
from torch import nn

from meshforge.utils.patterns import match_modules

_STATS = ("last_aux_stats", "last_tokens_per_expert")


@runtime_checkable
class BatchNarrowable(Protocol):
    """A per-forward argument that holds per-row data and knows how to give a slice of its rows."""

    def narrow_batch(self, dim: int, start: int, stop: int) -> Self:
        """The same object for rows ``start:stop`` of the batch (``dim``: the batch dim of the tensors)."""
        ...


def apply_chunk_batch(
    model: nn.Module,
    *,
    chunks: int,
    modules: Sequence[str],
    batch_dim: int = 0,
    arg_indices: Sequence[int] = (0,),
    kwarg_names: Sequence[str] = (),
    key_path: str = "parallelism.chunk_mbs_modules",
) -> int:
    """Make every module matching `modules` run its forward on `chunks` slices of the batch.

    Returns:
        How many modules were wrapped.

    Raises:
        ValueError: `chunks < 1`, or a pattern that is invalid or matches nothing (naming `key_path`).
    """
    if chunks < 1:
        raise ValueError(f"parallelism.chunk_mbs: must be >= 1, got {chunks}")
    matched = [module for _, module in match_modules(model, list(modules), key_path=key_path)]
    for module in matched:
        module.forward = functools.partial(
            _chunked_forward,
            module.forward,
            chunks=chunks,
            dim=batch_dim,
            arg_indices=frozenset(arg_indices),
            kwarg_names=frozenset(kwarg_names),
            # Found once here, not walked on every forward: the MoE blocks that keep statistics.
            holders=tuple(m for m in module.modules() if any(hasattr(m, name) for name in _STATS)),
        )
    return len(matched)


def _chunked_forward(
    forward: Callable[..., object],
    *args: object,
    chunks: int,
    dim: int,
    arg_indices: frozenset[int],
    kwarg_names: frozenset[str],
    holders: tuple[nn.Module, ...],
    **kwargs: object,
) -> object:
    batch = _batch_size(args, kwargs, arg_indices, kwarg_names, dim)
    if batch is None or batch < 2 or chunks == 1:
        return forward(*args, **kwargs)
    bounds = _bounds(batch, min(chunks, batch))
    outputs, stats = [], []
    for start, stop in bounds:
        part_args = [_slice(a, start, stop, dim, batch, force=i in arg_indices) for i, a in enumerate(args)]
        part_kwargs = {
            k: _slice(v, start, stop, dim, batch, force=k in kwarg_names) for k, v in kwargs.items()
        }
        outputs.append(forward(*part_args, **part_kwargs))
        stats.append(_read_stats(holders))
    _write_stats(stats)
    return _join(outputs, dim)


def _batch_size(
    args: tuple[object, ...],
    kwargs: dict[str, object],
    indices: frozenset[int],
    names: frozenset[str],
    dim: int,
) -> int | None:
    for i in sorted(indices):
        arg = args[i] if i < len(args) else None
        if isinstance(arg, torch.Tensor):
            return int(arg.shape[dim])
    for name in sorted(names):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return int(value.shape[dim])
    return None


def _bounds(batch: int, chunks: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible (the first `batch % chunks` slices one row longer)."""
    size, extra = divmod(batch, chunks)
    out, start = [], 0
    for i in range(chunks):
        stop = start + size + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _slice(value: object, start: int, stop: int, dim: int, batch: int, *, force: bool) -> object:
    if isinstance(value, BatchNarrowable) and not isinstance(value, torch.Tensor):
        return value.narrow_batch(dim, start, stop)
    if isinstance(value, torch.Tensor):
        if value.ndim > dim and (force or value.shape[dim] == batch):
            return value.narrow(dim, start, stop - start)
        return value
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_slice(v, start, stop, dim, batch, force=force) for v in value)
    return value


def _join(outputs: list[Any], dim: int) -> object:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=dim)
    if isinstance(first, tuple):
        return tuple(_join([o[i] for o in outputs], dim) for i in range(len(first)))
    if first is None:
        return None
    raise TypeError(
        f"parallelism.enable_chunk_batch: cannot join outputs of type {type(first).__name__} "
        "(a chunked module must return tensors or tuples of tensors)"
    )


def _read_stats(holders: tuple[nn.Module, ...]) -> list[tuple[nn.Module, str, Any]]:
    found = []
    for module in holders:
        for name in _STATS:
            value = getattr(module, name, None)
            if value is not None:
                found.append((module, name, value))
    return found


def _write_stats(per_chunk: list[list[tuple[nn.Module, str, Any]]]) -> None:
    """Sum each MoE statistic over the chunks (they are token sums) and leave the total behind."""
    if not per_chunk or not per_chunk[0]:
        return
    for position, (module, name, _) in enumerate(per_chunk[0]):
        values = [chunk[position][2] for chunk in per_chunk]
        if isinstance(values[0], torch.Tensor):
            total = functools.reduce(torch.add, values)
        else:  # RouterStats: a dataclass of additive tensors (and a non-tensor group)
            fields = {
                f.name: functools.reduce(torch.add, [getattr(v, f.name) for v in values])
                for f in dataclasses.fields(values[0])
                if isinstance(getattr(values[0], f.name), torch.Tensor)
            }
            total = dataclasses.replace(values[0], **fields)
        setattr(module, name, total)
