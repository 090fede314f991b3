"""Pipeline layout: schedule names, stage placement and the assignment of decoder layers to stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

LAYERS_KEY = "parallelism.pipeline_parallel_layers_per_stage"
SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"


# Canonical schedule name -> (torch class name, stages per rank: "one" or "many", placement).
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("ScheduleGPipe", "one", "loop"),
    "1f1b": ("Schedule1F1B", "one", "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", "many", "loop"),
    "interleavedzerobubble": ("ScheduleInterleavedZeroBubble", "many", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "many", "v"),
}
_ALIASES = {
    "interleaved": "interleaved1f1b",
    "zerobubble": "interleavedzerobubble",
    "zb": "interleavedzerobubble",
    "zbvzerobubble": "zbv",
}
ZERO_BUBBLE = ("interleavedzerobubble", "zbv")


def canonical_schedule(name: str) -> str:
    """Normalise a schedule name (case, ``_``/``-`` ignored; ``interleaved`` = ``interleaved1f1b``).

    Raises:
        ValueError: naming ``parallelism.pipeline_parallel_schedule`` for an unknown name.
    """
    key = str(name).lower().replace("_", "").replace("-", "").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        valid = ", ".join([*SCHEDULES, *_ALIASES])
        raise ValueError(f"{SCHEDULE_KEY}: unknown schedule {name!r}; valid: {valid}")
    return key


@dataclass(frozen=True)
class StageInfo:
    """One (virtual) pipeline stage.

    Attributes:
        index: Global stage index (0 = embedding side).
        rank: The pp rank that runs it.
        layers: Global decoder-layer indices it runs, ascending and contiguous.
        is_first: Runs the embedding.
        is_last: Runs the final norm and the LM head.
    """

    index: int
    rank: int
    layers: tuple[int, ...]
    is_first: bool
    is_last: bool

    @property
    def layer_keys(self) -> tuple[str, ...]:
        """Keys of its layers in the pruned ``model.layers`` ModuleDict."""
        return tuple(str(i) for i in self.layers)


@dataclass
class PipelineSplit:
    """What ``split_model`` decided for this rank.

    Attributes:
        model: The pruned model (the same object that was passed in).
        stages: This rank's stages, by ascending index.
        all_stages: Every stage of the pipeline, by index.
        pp_rank, pp_size, interleave: The layout.
        schedule: Canonical schedule name (``canonical_schedule``).
        tied_across_ranks: Tied input/output embeddings whose two ends live on different ranks:
            this rank's ``lm_head.weight`` (last stage) is a separate copy kept equal to
            ``model.embed_tokens.weight`` (stage 0).
        mtp_layers: Multi-token-prediction blocks after the decoder layers (DeepSeek-V3); the
            last stage runs them after the final norm.
        embedding_copy: The last stage holds its own ``model.embed_tokens.weight`` for the MTP
            blocks, kept equal to stage 0's (gradients summed) as a tied head is.
    """

    model: nn.Module
    stages: list[StageInfo]
    all_stages: list[StageInfo]
    pp_rank: int
    pp_size: int
    interleave: int
    schedule: str
    tied_across_ranks: bool = False
    mtp_layers: int = 0
    embedding_copy: bool = False

    @property
    def num_stages(self) -> int:
        """Total number of (virtual) stages, ``pp_size * interleave``."""
        return len(self.all_stages)

    @property
    def first_rank(self) -> int:
        """The pp rank running stage 0 (the embedding)."""
        return self.all_stages[0].rank

    @property
    def last_rank(self) -> int:
        """The pp rank running the last stage (norm and LM head)."""
        return self.all_stages[-1].rank

    @property
    def has_first(self) -> bool:
        """This rank runs stage 0."""
        return self.pp_rank == self.first_rank

    @property
    def has_last(self) -> bool:
        """This rank runs the last stage."""
        return self.pp_rank == self.last_rank

    @property
    def stage_ids(self) -> list[int]:
        """Indices of this rank's stages."""
        return [s.index for s in self.stages]

    @property
    def tied_copies(self) -> tuple[str, ...]:
        """Names on this rank that copy a parameter held by another pp rank.

        A norm or any other sum over the pp ranks must leave these out: with tied embeddings
        split across ranks, ``lm_head.weight`` on the last rank is the same weight (and, after
        ``Pipeline.step``, the same gradient) as the embedding on the first rank.
        """
        if self.embedding_copy and self.has_last:
            return ("model.embed_tokens.weight",)  # a tied head is this same parameter
        return ("lm_head.weight",) if self.tied_across_ranks and self.has_last else ()


# ----------------------------------------------------------------------------------------
# Layer assignment
# ----------------------------------------------------------------------------------------


def stage_rank(stage: int, pp_size: int, placement: str) -> int:
    """The pp rank that runs ``stage``: looping (``stage % pp``) or V-shaped (zero-bubble V)."""
    if placement == "v":
        rnd, pos = divmod(stage, pp_size)
        return pos if rnd % 2 == 0 else pp_size - 1 - pos
    return stage % pp_size


def _rank_chunk_stage(rank: int, chunk: int, pp_size: int, placement: str) -> int:
    """Virtual stage of chunk ``chunk`` on ``rank``: ``chunk * pp + rank`` (looping placement)."""
    if placement == "v":
        return chunk * pp_size + (rank if chunk % 2 == 0 else pp_size - 1 - rank)
    return chunk * pp_size + rank


def _auto_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible; extra layers go to the middle stages first.

    The first and last stages also run the embedding and the head, so they are the last to get
    an extra layer.
    """
    base, extra = divmod(num_layers, num_stages)
    order = (
        list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    )
    sizes = [base] * num_stages
    for stage in order[:extra]:
        sizes[stage] += 1
    return sizes


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers, as inclusive ``(lo, hi)`` pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _rank_chunks(spec: Any, pp_size: int, interleave: int) -> list[list[tuple[int, int]]]:
    """Parse an explicit spec into, per rank, its chunks as inclusive layer ranges."""
    from meshforge.config.layer_spec import parse_layer_spec

    if not isinstance(spec, list | tuple) or len(spec) != pp_size:
        got = f"{len(spec)} entries" if isinstance(spec, list | tuple) else repr(spec)
        raise ValueError(
            f"{LAYERS_KEY}: needs 'auto' or one entry per pipeline rank (pipeline_parallel = {pp_size}), got {got}"
        )
    per_rank: list[list[tuple[int, int]]] = []
    for rank, item in enumerate(spec):
        path = f"{LAYERS_KEY}[{rank}]"
        if isinstance(item, str):
            chunks = []
            for text in item.split(","):
                try:
                    rng = parse_layer_spec(text)
                except ValueError as exc:
                    raise ValueError(f"{path}: {exc}") from None
                chunks.append((rng.lo, rng.hi))
        elif isinstance(item, list | tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in item
        ):
            if list(item) != sorted(set(item)) or any(i < 0 for i in item):
                raise ValueError(
                    f"{path}: layer indices must be ascending, distinct and >= 0, got {list(item)}"
                )
            # A rank's chunks are separated by other ranks' stages, so each is one maximal run.
            chunks = _runs(item)
        else:
            raise ValueError(
                f"{path}: write the rank's chunks as a string like '0-3,8-11' or a list of layer indices, got {item!r}"
            )
        if len(chunks) != interleave:
            shown = ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in chunks)
            raise ValueError(
                f"{path}: has {len(chunks)} chunk(s) ({shown}); needs pipeline_parallel_interleave_num = "
                f"{interleave} contiguous chunks per rank"
            )
        per_rank.append(chunks)
    return per_rank


def assign_layers(
    num_layers: int,
    *,
    pp_size: int,
    layers_per_stage: Any = "auto",
    interleave: int = 1,
    placement: str = "loop",
) -> list[StageInfo]:
    """Decide the layers and the rank of every (virtual) stage.

    Args:
        num_layers: Decoder layers in the model.
        pp_size: Pipeline ranks.
        layers_per_stage: ``'auto'`` (or None): contiguous, as even as possible. Otherwise one
            entry per rank, each holding ``interleave`` chunks: a string ``'0-3,8-11'`` (chunk
             ``c`` on rank ``r`` is virtual stage ``c * pp + r``) or a list of the global
            layer indices the rank runs (``[[0, 1, 4], [2, 3, 5]]``; each maximal run of
            consecutive indices is one chunk).
        interleave: Stages per rank (``pipeline_parallel_interleave_num``).
        placement: ``loop`` (stage ``s`` on rank ``s % pp``) or ``v`` (zero-bubble V schedule).

    Returns:
        Every stage by index; the stages tile ``0..num_layers-1`` in order.

    Raises:
        ValueError: naming ``parallelism.pipeline_parallel_layers_per_stage`` when the spec does
            not cover every layer exactly once in stage order or does not fit pp x interleave.
    """
    num_stages = pp_size * interleave
    if layers_per_stage is None or layers_per_stage == "auto":
        if num_layers < num_stages:
            raise ValueError(
                f"{LAYERS_KEY}: 'auto' needs at least one layer per stage: {num_layers} layers for "
                f"pipeline_parallel ({pp_size}) x interleave ({interleave}) = {num_stages} stages"
            )
        ranges, lo = [], 0
        for size in _auto_sizes(num_layers, num_stages):
            ranges.append((lo, lo + size - 1))
            lo += size
    elif isinstance(layers_per_stage, str):
        raise ValueError(f"{LAYERS_KEY}: a string must be 'auto', got {layers_per_stage!r}")
    else:
        by_stage: dict[int, tuple[int, int]] = {}
        for rank, chunks in enumerate(_rank_chunks(layers_per_stage, pp_size, interleave)):
            for c, chunk in enumerate(chunks):
                by_stage[_rank_chunk_stage(rank, c, pp_size, placement)] = chunk
        ranges = [by_stage[s] for s in range(num_stages)]
        expected = 0
        for s, (lo, hi) in enumerate(ranges):
            if lo != expected:
                raise ValueError(
                    f"{LAYERS_KEY}: stage {s} (rank {stage_rank(s, pp_size, placement)}) starts at layer {lo}, "
                    f"expected {expected}: the stages in order must cover layers 0..{num_layers - 1} exactly once"
                )
            expected = hi + 1
        if expected != num_layers:
            raise ValueError(
                f"{LAYERS_KEY}: the stages cover layers 0..{expected - 1}; the model has {num_layers}"
            )
    return [
        StageInfo(
            index=s,
            rank=stage_rank(s, pp_size, placement),
            layers=tuple(range(lo, hi + 1)),
            is_first=s == 0,
            is_last=s == num_stages - 1,
        )
        for s, (lo, hi) in enumerate(ranges)
    ]


__all__ = [
    "LAYERS_KEY",
    "SCHEDULES",
    "SCHEDULE_KEY",
    "ZERO_BUBBLE",
    "PipelineSplit",
    "StageInfo",
    "assign_layers",
    "canonical_schedule",
    "stage_rank",
]
