"""Pipeline parallelism on ``torch.distributed.pipelining``: layer split, stage modules, schedules.

The trainer calls this in two places (see ``Trainer._build_model``):

1. ``split_model`` on the meta model, before TP/FSDP/materialisation: it decides which decoder
   layers every (virtual) stage runs and prunes the model in place to what this pp rank hosts.
   The layers stay under ``model.layers`` in a ``ModuleDict`` keyed by their *global* index, so
   parameter names (``model.layers.7.mlp.up_proj.weight``) are those of the whole model and a
   checkpoint saved in one pipeline layout loads in another. The embedding lives only where
   stage 0 runs, the final norm and head only where the last stage runs.
2. ``build_pipeline`` after FSDP and materialisation: one ``PipelineStage`` per local stage and
   the schedule. ``Pipeline.step`` then runs forward and backward of all micro-batches.

Why the stages call the pruned root model instead of its children: FSDP2 (applied by the
trainer to the whole pruned model) gathers the root's own parameters (embedding, norm, head) in
the root's forward hook. Each stage therefore runs ``root(x, ..., pp_stage=i)``; the root's class
is swapped for a subclass whose ``forward`` runs only stage ``i``'s part. ``StageModule`` still
registers the stage's layers (and embedding/head) as children so that ``parameters()`` of a
stage is exactly what it computes (the zero-bubble weight pass iterates it).

Tied embeddings: when stage 0 and the last stage are on different ranks, the last rank keeps
its own ``lm_head.weight``. ``build_pipeline`` copies the embedding's values into it (whatever
materialisation or checkpoint loading put there), and ``Pipeline.step`` sums the two gradients
over the two ranks, so both copies get the same update as the single tied weight would.

Families: the ``DecoderModel`` families, gpt_oss and qwen3_next; ``pipeline_stage.py`` holds
the stage forward and, per family, what a stage builds before its layers (masks, RoPE).
The generic transformers path (``models/generic.py``) splits the same way when the model has
the usual layout (``model.embed_tokens``, ``model.layers`` ModuleList, ``model.norm``,
``model.rotary_emb``, ``lm_head``) and a model type whose forward a stage reproduces
(``GENERIC_MASK_RULES``); a tied head is the same shared Parameter there, so it is detected by
identity, and the copy on the last rank is kept equal as for the built-in families.

MoE router aux loss (``aux_coef`` of ``build_pipeline``): transformers' loss is one product
over the statistics of *all* MoE layers, which live on different stages. Each stage therefore
returns, next to the hidden states, a float32 ``carry`` of ``2 * E + 1`` values: the running
sums over the layers so far of the router probabilities (with autograd), the top-k assignments
and the rows (no gradient). The last stage forms the loss from the totals in its loss
function, so autograd sends ``d aux / d prob_sum`` (which needs the global assignment totals of
that micro-batch) back through the schedule's own gradient messages to every stage's routers:
exactly the single-process gradient, and the exact value for the log.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.loss import chunked_cross_entropy_sum, count_valid_tokens, cross_entropy_sum
from meshforge.models.spec import is_generic_model
from meshforge.parallel.pipeline_stage import (
    StageModule,
    _PipelinedCausalLM,
    check_generic_layout,
    pipelined_class,
    router_aux_experts,
    stage_preparation,
)

LAYERS_KEY = "parallelism.pipeline_parallel_layers_per_stage"
SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"


# Canonical schedule name -> (torch class name, stages per rank: "one" or "many", placement).
_SCHEDULES: dict[str, tuple[str, str, str]] = {
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
_ZERO_BUBBLE = ("interleavedzerobubble", "zbv")


def canonical_schedule(name: str) -> str:
    """Normalise a schedule name (case, ``_``/``-`` ignored; ``interleaved`` = ``interleaved1f1b``).

    Raises:
        ValueError: naming ``parallelism.pipeline_parallel_schedule`` for an unknown name.
    """
    key = str(name).lower().replace("_", "").replace("-", "").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key not in _SCHEDULES:
        valid = ", ".join([*_SCHEDULES, *_ALIASES])
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
    """

    model: nn.Module
    stages: list[StageInfo]
    all_stages: list[StageInfo]
    pp_rank: int
    pp_size: int
    interleave: int
    schedule: str
    tied_across_ranks: bool = False

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
            entry per rank, each holding ``interleave`` chunks: a string ``'0-3,8-11'`` (NOTES:
            chunk ``c`` on rank ``r`` is virtual stage ``c * pp + r``) or a list of the global
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


# ----------------------------------------------------------------------------------------
# Pruning the model (the stage forward itself is in pipeline_stage.py)
# ----------------------------------------------------------------------------------------


def _check_supported(model: nn.Module) -> None:
    """Refuse a model whose family has no stage preparation (``FamilySpec.stage_preparation``)."""
    if isinstance(model, _PipelinedCausalLM):
        raise ValueError("split_model: the model is already split (model.layers is not a ModuleList)")
    if is_generic_model(model):
        check_generic_layout(model)
        return
    family = getattr(model, "family", None) or getattr(getattr(model, "config", None), "model_type", None)
    family = family or type(model).__name__
    inner = getattr(model, "model", None)
    if inner is None or stage_preparation(type(model)) is None:
        raise NotImplementedError(f"not supported yet: parallelism.pipeline_parallel > 1 for {family}")
    if not isinstance(inner.layers, nn.ModuleList):
        raise ValueError("split_model: the model is already split (model.layers is not a ModuleList)")


def split_model(
    model: nn.Module,
    *,
    pp_rank: int,
    pp_size: int,
    layers_per_stage: Any = "auto",
    interleave: int = 1,
    schedule: str = "1f1b",
) -> PipelineSplit:
    """Decide every stage's layers and prune ``model`` in place to what ``pp_rank`` runs.

    Call it on the meta model, before TP, FSDP and materialisation.

    Args:
        model: A built-in ``CausalLM`` of a family with a stage preparation, or a generic
            transformers model (``wrap_generic``) laid out as ``check_generic_layout`` describes.
        pp_rank: This rank's index on the pp mesh.
        pp_size: Pipeline ranks (``parallelism.pipeline_parallel``).
        layers_per_stage: ``parallelism.pipeline_parallel_layers_per_stage`` (see ``assign_layers``).
        interleave: ``parallelism.pipeline_parallel_interleave_num`` (stages per rank).
        schedule: ``parallelism.pipeline_parallel_schedule`` (decides the stage placement and
            whether several stages per rank are allowed).

    Returns:
        The split; ``split.model`` is ``model``, pruned: ``model.layers`` is a ModuleDict keyed by
        global layer index, ``embed_tokens`` is None unless this rank runs stage 0, ``norm`` and
        ``lm_head`` are None unless it runs the last stage.

    Raises:
        NotImplementedError: for families without pipeline support.
        ValueError: naming the config key for an invalid layout.
    """
    _check_supported(model)
    name = canonical_schedule(schedule)
    _, stages_per_rank, placement = _SCHEDULES[name]
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"split_model: pp_rank {pp_rank} is not in [0, {pp_size})")
    if interleave < 1:
        raise ValueError(f"parallelism.pipeline_parallel_interleave_num: must be >= 1, got {interleave}")
    if stages_per_rank == "one" and interleave != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_interleave_num: {interleave} stages per rank need an interleaved "
            f"schedule ({SCHEDULE_KEY}: interleaved or zero_bubble), not {schedule!r}"
        )
    if name == "zbv" and interleave != 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_interleave_num: the zbv schedule runs exactly 2 stages per rank, "
            f"got {interleave}"
        )
    inner: Any = model.model
    num_layers = len(inner.layers)
    if is_generic_model(model):
        # transformers ties by sharing one Parameter (``tie_word_embeddings``; or its own rules).
        tied_model = model.lm_head.weight is inner.embed_tokens.weight
    else:
        tied_model = bool(getattr(model.args, "tie_word_embeddings", False))
    all_stages = assign_layers(
        num_layers,
        pp_size=pp_size,
        layers_per_stage=layers_per_stage,
        interleave=interleave,
        placement=placement,
    )
    local = [s for s in all_stages if s.rank == pp_rank]
    hosted = sorted(i for s in local for i in s.layers)
    old_layers = inner.layers
    inner.layers = nn.ModuleDict({str(i): old_layers[i] for i in hosted})
    first_rank, last_rank = all_stages[0].rank, all_stages[-1].rank
    if pp_rank != first_rank:
        inner.embed_tokens = None
    if pp_rank != last_rank:
        inner.norm = None
        model.lm_head = None
    # With the embedding gone, a tied lm_head.weight is now a parameter of its own on this rank.
    tied = tied_model and first_rank != last_rank
    model.__class__ = pipelined_class(type(model))
    model._pp_stages = {s.index: s for s in local}
    return PipelineSplit(
        model=model,
        stages=local,
        all_stages=all_stages,
        pp_rank=pp_rank,
        pp_size=pp_size,
        interleave=interleave,
        schedule=name,
        tied_across_ranks=tied,
    )


# ----------------------------------------------------------------------------------------
# Schedule and step
# ----------------------------------------------------------------------------------------


# Action types a forward-only pass keeps: the forwards, their transfers, FSDP's (un)shards.
_FORWARD_ACTIONS = ("FORWARD", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")


@contextmanager
def _forward_only(schedule: Any, enabled: bool) -> Iterator[None]:
    """Run ``schedule`` (a torch runtime schedule) with its backward actions left out, inside the block.

    Why zbv needs it: in eval mode torch's runtime skips the backward computations but still hands
    the input gradient of a V-schedule stage to the previous stage when both sit on the same rank
    (stages ``pp`` and ``pp - 1`` on the last pp rank), and asks a stage without backward for it
    (``get_local_bwd_output``: an AssertionError). Without the backward actions the order is each
    rank's forwards in the schedule's own order, with their sends and receives: every forward's
    input comes from a forward the schedule already ran before it, and dropping actions only
    removes waits, so the order cannot deadlock. The full order (same schedule object, so the
    stages' eval/train re-initialisation stays torch's own) is put back on exit. It edits the
    runtime's lowered order, ``pipeline_order_with_comms`` (what its ``_step_microbatches`` runs).
    """
    if not enabled:
        yield
        return
    full = schedule.pipeline_order_with_comms
    forward_only: dict[int, list[Any]] = {}
    for rank, actions in full.items():
        kept: list[Any] = []
        for action in actions:
            subs = getattr(action, "sub_actions", None) or (action,)  # an overlapped F/B pair: its F
            kept.extend(a for a in subs if a.computation_type.name in _FORWARD_ACTIONS)
        forward_only[rank] = kept
    schedule.pipeline_order_with_comms = forward_only
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _describe(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    from torch.distributed.tensor import DTensor

    placements = str(tuple(t.placements)) if isinstance(t, DTensor) else "plain"
    return tuple(_local(t).shape), placements


def check_microbatches(schedule: str, n_microbatches: int, pp_size: int) -> None:
    """Raise a config-level error when ``schedule`` cannot run ``n_microbatches`` micro-batches.

    Raises:
        ValueError: naming ``training.global_batch_size`` / ``training.local_batch_size``.
    """
    name = canonical_schedule(schedule)
    need = None
    if n_microbatches < 1:
        need = "at least 1"
    elif name == "1f1b" and n_microbatches < pp_size:
        need = f"at least pipeline_parallel = {pp_size}"
    elif name in ("interleaved1f1b", "interleavedzerobubble"):
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            need = (
                f"a count divisible by max(1, micro-batches // pipeline_parallel) = {rounds} "
                "(e.g. a multiple of pipeline_parallel)"
            )
    if need:
        raise ValueError(
            f"training.global_batch_size / training.local_batch_size: {n_microbatches} micro-batches per step "
            f"(global_batch_size / (local_batch_size x data-parallel ranks)); the {name} schedule with "
            f"pipeline_parallel = {pp_size} needs {need}"
        )


class Pipeline:
    """The stages and schedule of this rank; ``step`` runs one optimizer step's micro-batches.

    Built by ``build_pipeline``.
    """

    def __init__(
        self,
        split: PipelineSplit,
        model: nn.Module,
        pp_group: dist.ProcessGroup,
        *,
        device: torch.device,
        n_microbatches: int,
        schedule_name: str,
        aux_coef: float = 0.0,
        chunk_loss_size: int | None = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.split = split
        self.model = model
        self.group = pp_group
        self.device = torch.device(device)
        self.schedule_name = schedule_name
        self.aux_coef = float(aux_coef)
        self.aux_experts = router_aux_experts(model) if self.aux_coef != 0.0 else None
        # Every stage forward then returns (hidden, carry); see the module docstring.
        model._pp_aux_experts = self.aux_experts
        self.chunk_loss_size = chunk_loss_size
        model._pp_return_hidden = chunk_loss_size is not None
        self._aux: list[torch.Tensor] = []
        self.aux_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.stages = [
            PipelineStage(StageModule(model, s), s.index, split.num_stages, self.device, group=pp_group)
            for s in split.stages
        ]
        self._schedules: dict[int, Any] = {}
        self._global_tokens: torch.Tensor | None = None
        self._ce: list[torch.Tensor] = []
        self._shape: tuple[int, ...] | None = None
        self.schedule = self._schedule_for(n_microbatches)

    def _ce_sum(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed CE of the last stage's output: logits, or normed hidden states (chunked loss)."""
        if self.chunk_loss_size is None:
            return cross_entropy_sum(output, labels)
        # Read after the forward: under FSDP the head is unsharded by then.
        weight = self.model.lm_head.weight
        return chunked_cross_entropy_sum(output, weight, labels, chunk_size=self.chunk_loss_size)

    def _loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        if self.aux_experts is None:
            ce = self._ce_sum(output, labels)
            self._ce.append(ce.detach())
            return ce / self._global_tokens
        logits, carry = output
        ce = self._ce_sum(logits, labels)
        self._ce.append(ce.detach())
        aux = self._aux_from_carry(carry)
        # As Trainer.forward_backward: the micro-batch's aux loss weighted by its share of the
        # global valid tokens (on a CP rank: its own part of them; the shares add up).
        weight = count_valid_tokens(labels).to(torch.float32) / self._global_tokens
        self._aux.append((aux.detach() * weight).float())
        return ce / self._global_tokens + self.aux_coef * aux * weight

    def _aux_from_carry(self, carry: torch.Tensor) -> torch.Tensor:
        """The Switch aux loss of one micro-batch from the totals carried through the stages."""
        from meshforge.models.common.moe import reduce_router_totals, switch_loss

        e = int(self.aux_experts)  # type: ignore[arg-type]
        # Only the probability sums carry gradient; the counts' gradient would be meaningless.
        prob_sum, assignments, rows = carry[:e], carry[e : 2 * e].detach(), carry[2 * e].detach()
        group = getattr(self.model, "aux_reduce_group", None)  # the CP group, when CP splits rows
        assignments, prob_sum, rows = reduce_router_totals(assignments, prob_sum, rows, group)
        return switch_loss(assignments, prob_sum, rows, e)

    def _schedule_for(self, n_microbatches: int) -> Any:
        if n_microbatches not in self._schedules:
            import torch.distributed.pipelining.schedules as schedules

            check_microbatches(self.schedule_name, n_microbatches, self.split.pp_size)
            cls_name, stages_per_rank, _ = _SCHEDULES[self.schedule_name]
            cls = getattr(schedules, cls_name)
            stages = self.stages[0] if stages_per_rank == "one" else self.stages
            # scale_grads=False: the loss is already divided by the global token count.
            try:
                self._schedules[n_microbatches] = cls(
                    stages, n_microbatches, loss_fn=self._loss, scale_grads=False
                )
            except ValueError as exc:
                raise ValueError(
                    f"training.global_batch_size / training.local_batch_size: {n_microbatches} micro-batches "
                    f"per step do not fit the {self.schedule_name} schedule: {exc}"
                ) from None
        return self._schedules[n_microbatches]

    def step(self, micro: list[dict[str, torch.Tensor]], global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch through the pipeline.

        Args:
            micro: One dict per micro-batch with ``input_ids`` and ``labels`` ``[B, S]`` (labels
                already shifted, -100 ignored) and optionally ``position_ids``, ``segment_ids``.
            global_tokens: Valid label tokens of the whole global batch (all micro-batches, all
                data-parallel ranks); each micro-batch's loss is its CE sum divided by it.

        Returns:
            The CE sum of this rank's micro-batches (float32, detached, 0-dim), the same on
            every pp rank. Gradients are accumulated into ``.grad`` (tied embedding/head
            gradients already summed across the pp ranks holding them). With the router aux
            loss on, ``self.aux_sum`` then holds the sum over the micro-batches of each one's
            aux loss times its token weight (what ``Trainer.forward_backward`` adds to its
            ``_aux_sum``), the same on every pp rank.
        """
        total = self._run(micro, global_tokens, train=True)
        self._sum_tied_grads()
        return total

    def _run(
        self, micro: list[dict[str, torch.Tensor]], global_tokens: torch.Tensor, *, train: bool
    ) -> torch.Tensor:
        if not micro:
            raise ValueError("Pipeline.step: no micro-batches")
        # Other keys are ignored, as the single-stage forward ignores them.
        keys = [k for k in ("input_ids", "labels", "position_ids", "segment_ids") if k in micro[0]]
        for i, mb in enumerate(micro):
            if [k for k in ("input_ids", "labels", "position_ids", "segment_ids") if k in mb] != keys:
                raise ValueError(
                    f"Pipeline.step: micro-batch {i} has keys {sorted(mb)}, micro-batch 0 {keys}"
                )
        shape = tuple(micro[0]["input_ids"].shape)
        if any(tuple(mb["input_ids"].shape) != shape for mb in micro) or self._shape not in (None, shape):
            got = sorted({tuple(mb["input_ids"].shape) for mb in micro})
            raise ValueError(
                f"Pipeline: micro-batches of shape {got} after {self._shape or shape}: the stages' "
                "transfer buffers are sized by the first micro-batch, so every micro-batch needs the same "
                "[local_batch_size, sequence length] (pad to a fixed length, e.g. train_dataset.cutoff_len)"
            )
        self._shape = shape
        schedule = self._schedule_for(len(micro))
        batch = {k: torch.cat([mb[k] for mb in micro]).to(self.device) for k in keys}
        kwargs: dict[str, Any] = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
        kwargs["seq_len"] = int(batch["input_ids"].shape[-1])  # not a tensor: every micro-batch gets it
        args = (batch["input_ids"],) if self.split.has_first else ()
        target = batch["labels"] if self.split.has_last else None
        self._global_tokens = global_tokens.to(self.device)
        self._ce = []
        self._aux = []
        if train:
            self._set_fsdp_sync(False)
            try:
                schedule.step(*args, target=target, return_outputs=False, **kwargs)
            finally:
                self._set_fsdp_sync(True)
            self._fsdp_reduce_grads()
        else:
            # eval() forwards its keyword arguments to step(), return_outputs included.
            with _forward_only(schedule, self.schedule_name == "zbv"):
                schedule.eval(*args, target=target, return_outputs=False, **kwargs)
        # The first run in a mode also calls the loss once for shape inference: keep the real calls.
        ce = self._ce[-len(micro) :] if self.split.has_last else []
        total = torch.stack(ce).sum() if ce else torch.zeros((), dtype=torch.float32, device=self.device)
        total = total.float()
        if self.aux_experts is not None:
            # Only the last stage's rank computed the aux values; one all-reduce for both sums.
            aux = self._aux[-len(micro) :] if self.split.has_last else []
            aux_total = torch.stack(aux).sum() if aux else torch.zeros((), device=self.device)
            both = torch.stack([total, aux_total.float()])
            dist.all_reduce(both, group=self.group)
            total = both[0]
            if train:  # evaluation leaves the training step's value alone
                self.aux_sum = both[1]
        else:
            dist.all_reduce(total, group=self.group)
        self._ce = []
        self._aux = []
        return total

    def _set_fsdp_sync(self, sync: bool) -> None:
        """Gradient sync of an FSDP-wrapped model on (each backward reduces) or off (accumulate).

        The stages call the FSDP root through ``StageModule``, which is no ``FSDPModule``, so
        the schedule's own FSDP handling does not apply; this does what it would do (reduce
        once per step, after the last micro-batch).
        """
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)
            self.model.set_reshard_after_backward(sync)
            self.model.set_is_last_backward(sync)

    def _fsdp_reduce_grads(self) -> None:
        """Reduce-scatter the gradients accumulated over the step's micro-batches (FSDP only)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.model, FSDPModule):
            return
        state = fully_shard.state(self.model)
        for module_state in state._state_ctx.all_states:
            for group in module_state._fsdp_param_groups:
                group.post_backward()
        # Waits for the reductions and reshards, as at the end of an ordinary backward.
        state._root_post_backward_final_callback()

    @torch.no_grad()
    def evaluate(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward only: the CE sum of ``micro`` (float32, 0-dim), the same on every pp rank.

        Every schedule runs its own action order with the backward actions idle; zbv runs its
        forward actions only (see :func:`_forward_only`).

        Args:
            micro: Micro-batches as for ``step``.
        """
        return self._run(micro, torch.ones((), device=self.device), train=False)

    def _tied_pair(self) -> tuple[nn.Parameter | None, int]:
        """This rank's end of a tied pair split across ranks, and the peer's global rank."""
        split = self.split
        if not split.tied_across_ranks or not (split.has_first or split.has_last):
            return None, -1
        inner: Any = self.model.model
        if split.has_first:
            return inner.embed_tokens.weight, dist.get_global_rank(self.group, split.last_rank)
        return self.model.lm_head.weight, dist.get_global_rank(self.group, split.first_rank)

    def _exchange(self, mine: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``mine`` to ``peer`` and receive the peer's tensor of the same shape."""
        send = mine.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, peer, self.group), dist.P2POp(dist.irecv, recv, peer, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return recv

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        param, peer = self._tied_pair()
        if param is None:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        local = _local(param.grad)
        local.add_(self._exchange(local, peer))

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Copy the embedding's values into the last stage's ``lm_head.weight`` (tied models).

        Both ends must be laid out alike (same local shard shape and DTensor placements);
        the check runs on every pp rank so they all fail together.
        """
        split = self.split
        if not split.tied_across_ranks:
            return
        param, peer = self._tied_pair()
        info = _describe(param) if param is not None else None
        infos: list[Any] = [None] * split.pp_size
        dist.all_gather_object(infos, info, group=self.group)
        if infos[split.first_rank] != infos[split.last_rank]:
            raise ValueError(
                "tie_word_embeddings under pipeline parallelism: model.embed_tokens.weight (stage 0) and "
                f"lm_head.weight (last stage) are laid out differently ({infos[split.first_rank]} vs "
                f"{infos[split.last_rank]}); both ends need the same sharding"
            )
        if param is None:
            return
        if split.has_first:
            dist.send(_local(param).contiguous(), peer, group=self.group)
        else:
            local = _local(param)
            buf = torch.empty_like(local)
            dist.recv(buf, peer, group=self.group)
            local.copy_(buf)


def build_pipeline(
    split: PipelineSplit,
    model: nn.Module,
    pp_mesh: Any,
    *,
    device: torch.device | str,
    n_microbatches: int,
    schedule: str | None = None,
    dxdw_split: bool = False,
    aux_coef: float = 0.0,
    chunk_loss_size: int | None = None,
) -> Pipeline:
    """Build this rank's ``PipelineStage`` objects and the schedule, after FSDP and materialisation.

    Args:
        split: From ``split_model``.
        model: ``split.model`` after TP/FSDP/materialisation (the same object).
        pp_mesh: The 1-D "pp" DeviceMesh (or its ProcessGroup).
        device: Device the stages run on.
        n_microbatches: Micro-batches per optimizer step (the gradient-accumulation steps).
        schedule: ``parallelism.pipeline_parallel_schedule`` (default: the one given to
            ``split_model``): gpipe, 1f1b, interleaved (interleaved1f1b), zero_bubble
            (interleaved zero bubble) or zbv.
        dxdw_split: ``parallelism.pipeline_parallel_enable_dxdw_split``: run the interleaved
            schedule as its zero-bubble variant (separate input- and weight-gradient passes).
        aux_coef: The router aux loss coefficient (the trainer's ``aux_coef``). When non-zero
            and the model has the aux loss (MoE family, ``output_router_logits``), every
            micro-batch's loss gets ``aux_coef * aux * valid_tokens / global_tokens``, exactly
            as ``Trainer.forward_backward`` adds it, and ``Pipeline.aux_sum`` the logged value.
        chunk_loss_size: ``kernels.chunk_loss_size``: the last stage hands the normed hidden
            states to the loss, which applies ``lm_head`` that many tokens at a time.

    Returns:
        The pipeline; its tied weights (if any) are already equal on both ends.

    Raises:
        ValueError: naming the config key when the schedule does not match the split or the
            micro-batch count does not fit the schedule.
    """
    name = canonical_schedule(schedule or split.schedule)
    if dxdw_split and name not in _ZERO_BUBBLE:
        if name != "interleaved1f1b":
            raise ValueError(
                f"parallelism.pipeline_parallel_enable_dxdw_split: needs an interleaved or zero-bubble "
                f"schedule ({SCHEDULE_KEY}: interleaved, zero_bubble or zbv), not {name!r}"
            )
        name = "interleavedzerobubble"
    if name != split.schedule and _SCHEDULES[name][1:] != _SCHEDULES[split.schedule][1:]:
        raise ValueError(f"{SCHEDULE_KEY}: {name!r} does not match the split made for {split.schedule!r}")
    if model is not split.model:
        raise ValueError("build_pipeline: `model` must be split.model (after FSDP/materialisation)")
    group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
    if dist.get_world_size(group) != split.pp_size or dist.get_rank(group) != split.pp_rank:
        raise ValueError(
            f"build_pipeline: the pp mesh (size {dist.get_world_size(group)}, rank {dist.get_rank(group)}) "
            f"does not match the split (pp_size {split.pp_size}, pp_rank {split.pp_rank})"
        )
    pipeline = Pipeline(
        split,
        model,
        group,
        device=torch.device(device),
        n_microbatches=n_microbatches,
        schedule_name=name,
        aux_coef=aux_coef,
        chunk_loss_size=chunk_loss_size,
    )
    pipeline.sync_tied_weights()
    return pipeline


__all__ = [
    "Pipeline",
    "PipelineSplit",
    "StageInfo",
    "StageModule",
    "assign_layers",
    "build_pipeline",
    "canonical_schedule",
    "check_microbatches",
    "split_model",
]
