"""CP batch layout: method names, which tokens each rank keeps, and the per-forward ``CPMask``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshforge.models.common.attention import positions_from_segments

CP_METHODS: tuple[str, ...] = ("colossal", "ulysses", "hybrid", "kvallgather")
#: Extra keys ``shard_batch_for_cp`` adds that the trainer passes to the model: none, the
#: attention gathers what it needs about the full row itself (see ``ContextParallel.prepare``).
CP_MODEL_KWARGS: tuple[str, ...] = ()
_ALIASES = {"ring": "colossal"}


def resolve_method(method: str) -> str:
    """The CP method name with aliases resolved (``ring`` -> ``colossal``).

    Raises:
        ValueError: For an unknown name, listing the valid ones.
    """
    name = _ALIASES.get(method, method)
    if name not in CP_METHODS:
        raise ValueError(
            f"parallelism.context_parallel_method: unknown {method!r}; valid: colossal (alias ring), "
            "ulysses, hybrid, kvallgather"
        )
    return name


def num_sequence_chunks(method: str, cp: int) -> int:
    """How many equal chunks a sequence is cut into: 2 * cp for the load-balanced layout, else cp."""
    return 2 * cp if resolve_method(method) in ("colossal", "hybrid") else cp


def local_token_index(seq_len: int, cp: int, rank: int, *, method: str) -> torch.Tensor:
    """Global sequence positions of the tokens CP rank ``rank`` keeps, in its local order.

    Args:
        seq_len: Full sequence length.
        cp: CP degree.
        rank: This rank's index in the CP mesh.
        method: CP method; colossal and hybrid keep chunks ``rank`` and ``2cp-1-rank``
            of ``2cp``, ulysses and kvallgather the ``rank``-th of ``cp`` contiguous chunks.

    Returns:
        A CPU LongTensor ``[seq_len // cp]``.

    Raises:
        ValueError: If ``seq_len`` does not divide into the chunks the method needs.
    """
    method = resolve_method(method)
    chunks = num_sequence_chunks(method, cp)
    if seq_len % chunks:
        why = "2 * context_parallel, the load-balanced causal layout" if chunks == 2 * cp else "one per rank"
        raise ValueError(
            f"parallelism.context_parallel: {cp} with context_parallel_method {method} cuts each sequence "
            f"into {chunks} equal chunks ({why}), but the data's seq length is {seq_len}; use a seq_length "
            f"that is a multiple of {chunks}"
        )
    size = seq_len // chunks
    first = torch.arange(rank * size, (rank + 1) * size)
    if chunks == cp:
        return first
    mirror = chunks - 1 - rank
    return torch.cat([first, torch.arange(mirror * size, (mirror + 1) * size)])


def shard_batch_for_cp(
    batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh, *, method: str
) -> dict[str, torch.Tensor]:
    """This CP rank's part of every ``[B, S, ...]`` tensor of a micro-batch.

    ``position_ids`` are made explicit from the full row before slicing (global positions,
    restarting per document when ``segment_ids`` are given), so RoPE sees the positions a
    single process would. Other values (and tensors without the sequence dimension) pass
    through unchanged.

    Args:
        batch: ``input_ids``, ``labels`` and optional ``position_ids``/``segment_ids``, ``[B, S]``.
        cp_mesh: The 1-D context-parallel mesh.
        method: CP method (decides the layout).

    Returns:
        A new dict with ``[B, S // cp]`` tensors.

    Raises:
        ValueError: If the sequence length does not divide into the method's chunks.
    """
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[-1]
    index = local_token_index(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), method=method)
    index = index.to(input_ids.device)
    out = dict(batch)
    if out.get("position_ids") is None:
        segments = batch.get("segment_ids")
        if segments is not None:
            out["position_ids"] = positions_from_segments(segments)
        else:
            out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            out[key] = value.index_select(1, index)
    return out


def unshard_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, *, method: str, dim: int = 1) -> torch.Tensor:
    """Gather the CP ranks' slices of ``x`` along ``dim`` back into full sequence order (autograd-aware)."""
    cp = cp_mesh.size()
    local = x.shape[dim]
    gathered = funcol.all_gather_single_autograd(x.contiguous(), dim, cp_mesh.get_group())
    order = torch.cat([local_token_index(local * cp, cp, r, method=method) for r in range(cp)])
    return gathered.index_select(dim, torch.argsort(order).to(x.device))


class CPMask:
    """What every attention layer of one forward needs about the full rows.

    Built once per forward by ``ContextParallel.prepare`` and passed to the layers in
    place of the ``[B, 1, S, S]`` mask.

    Not a dataclass: FSDP2 casts each unit's forward inputs with a tree map that rebuilds
    dataclasses field by field, which would hand every layer its own copy of ``cache`` (and
    every layer would build and keep its own ring plan and masks: two ``[S/2, S/2]`` boolean
    masks a layer under load-balanced ring attention, 16 GiB over 32 layers at 64k tokens). A
    plain object is a leaf to such maps, so the layers of one forward share it.

    Attributes:
        q_index: Global positions of this rank's tokens ``[S_local]``.
        seq_len: Full sequence length.
        segments: Full-row document ids ``[B, S]`` in global order, or None (plain causal).
        cache: Masks derived from the above, shared by the layers of this forward.
    """

    __slots__ = ("cache", "q_index", "segments", "seq_len")

    def __init__(
        self,
        q_index: torch.Tensor,
        seq_len: int,
        segments: torch.Tensor | None,
        cache: dict[object, Any] | None = None,
    ) -> None:
        self.q_index = q_index
        self.seq_len = seq_len
        self.segments = segments
        self.cache: dict[object, Any] = {} if cache is None else cache

    def __repr__(self) -> str:
        rows = "none" if self.segments is None else f"{tuple(self.segments.shape)}"
        return f"CPMask(local tokens={self.q_index.numel()}, seq_len={self.seq_len}, segments={rows})"

    def narrow_rows(self, start: int, stop: int) -> CPMask:
        """This mask for batch rows ``start:stop`` (chunked micro-batches run layers on row slices).

        Only ``segments`` is per row; the derived masks in ``cache`` hold a row dimension too, so
        the slice gets a cache of its own. The slice is kept in this mask's cache, so every layer
        of the forward shares one per row range (and, through it, the masks it derives). Without
        documents nothing is per row and the mask itself is returned.

        Raises:
            ValueError: ``start:stop`` is not a non-empty range of the mask's rows.
        """
        if self.segments is None:
            return self
        rows = self.segments.shape[0]
        if not 0 <= start < stop <= rows:
            raise ValueError(f"CPMask.narrow_rows: rows {start}:{stop} of a {rows}-row batch")
        if (start, stop) == (0, rows):
            return self
        key = ("rows", start, stop)
        if key not in self.cache:
            self.cache[key] = CPMask(self.q_index, self.seq_len, self.segments[start:stop])
        return self.cache[key]

    def narrow_batch(self, dim: int, start: int, stop: int) -> CPMask:
        """``narrow_rows`` for :mod:`meshforge.parallel.chunk_batch` (objects with this method are sliced).

        Raises:
            ValueError: ``dim`` is not 0 (the mask's rows are the hidden states' dim 0).
        """
        if dim != 0:
            raise ValueError(
                f"parallelism.chunk_mbs_batch_dim: {dim}; under context parallelism the decoder layers' "
                "batch dimension is 0 (the per-row document ids of the CP mask), use 0"
            )
        return self.narrow_rows(start, stop)


__all__ = [
    "CPMask",
    "CP_METHODS",
    "CP_MODEL_KWARGS",
    "local_token_index",
    "num_sequence_chunks",
    "resolve_method",
    "shard_batch_for_cp",
    "unshard_sequence",
]
