"""The parallel plan of a config for N processes, computed without starting any.

`meshforge config validate --world-size N` prints it: the mesh (every axis and the views the
trainer uses), the batch plan (accumulation steps, pipeline micro-batches), and an estimate
of each rank's parameter, gradient and optimizer-state memory. The model is built on the meta
device (no weights, no memory), so a 1024-rank layout of a large model is planned in seconds
on a laptop. Activations are measured, not guessed: one forward and loss of the model at the
rank's shapes (micro-batch x sequence / cp) with the run's recompute and swap settings, traced on
fake tensors under the saved-tensor ledger (`memory.estimate`), then scaled to the rank: / tp
(sequence parallel), x the layers of its pipeline stage, x the micro-batches its schedule holds
in flight. The predicted peak per rank adds the buffers a step holds besides them
(`device_peak`: FSDP's unsharded parameters and gradients, the rebuilt layer, the loss's logits
gradients, the CUDA context and NCCL). Multi-token-prediction blocks (DeepSeek-V3) sit on
the last pipeline stage with their state, their activations when the run trains them, and the
stage's own copy of the embedding they read. A LoRA run's state is its frozen base's weights plus
its adapters, with gradients and optimizer state for the adapters only (`plan_lora`); its trace
runs the adapters on the frozen base, as the trainer attaches them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.plan_preference import ReferenceCost

if TYPE_CHECKING:
    from torch import nn

    from meshforge.config.root import TrainConfig
    from meshforge.loss.lm import LMLoss
    from meshforge.memory.estimate import ActivationEstimate
    from meshforge.parallel.plan_lora import AdapterCounts

_GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
# Parameter-name fragments of routed experts (sharded over ep x expert-FSDP, not TP).
_EXPERT_MARKERS = (".experts.",)
_LAYER_MARKER = ".layers."


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the model split by how they are placed across ranks."""

    embedding: int  # input embedding (first pipeline stage)
    head: int  # output head: its own weights, or a copy of a tied embedding on the last stage
    tied: bool
    layers: list[int]  # dense parameters of each decoder layer (MTP blocks last)
    experts: list[int]  # routed-expert parameters of each decoder layer (MTP blocks last)
    other: int  # final norm and anything outside the layers
    mtp_layers: int = 0  # trailing entries of `layers` that are MTP blocks (on the last stage)
    adapters: AdapterCounts | None = None  # a LoRA run's adapters (None: every parameter trains)

    @property
    def total(self) -> int:
        return (
            self.embedding
            + (0 if self.tied else self.head)
            + sum(self.layers)
            + sum(self.experts)
            + self.other
        )


def count_parameters(cfg: TrainConfig, log: Callable[[str], None] | None = None) -> tuple[str, ParamCounts]:
    """Build the configured model on the meta device and count its parameters by placement.

    The counts are the base model's; a LoRA run's adapters come in ``adapters``.
    """
    import torch

    from meshforge.checkpoint.source import resolve_model_source

    source = resolve_model_source(cfg.model, log=log)
    with torch.device("meta"):
        model = source.family.build(source.options)
    embedding = head = other = 0
    per_layer: dict[int, list[int]] = {}
    for name, param in model.named_parameters():
        n = param.numel()
        if _LAYER_MARKER in f".{name}":
            index = int(f".{name}".split(_LAYER_MARKER, 1)[1].split(".", 1)[0])
            slot = per_layer.setdefault(index, [0, 0])
            slot[1 if any(m in f".{name}" for m in _EXPERT_MARKERS) else 0] += n
        elif name.startswith("lm_head"):
            head += n
        elif "embed" in name:
            embedding += n
        else:
            other += n
    indices = sorted(per_layer)
    tied = head == 0
    # DeepSeek-V3's MTP blocks follow its decoder layers in model.layers (as split_model reads them).
    decoder = getattr(model.get_submodule("model"), "num_decoder_layers", len(indices))
    adapters = None
    if cfg.lora_config is not None:
        from meshforge.parallel.plan_lora import count_adapters

        adapters = count_adapters(cfg, source.family, model)
    return source.family.name, ParamCounts(
        embedding=embedding,
        head=embedding if tied else head,
        tied=tied,
        layers=[per_layer[i][0] for i in indices],
        experts=[per_layer[i][1] for i in indices],
        other=other,
        mtp_layers=len(indices) - int(decoder),
        adapters=adapters,
    )


def stage_layers(num_layers: int, pp: int, interleave: int, spec: Any) -> list[list[int]]:
    """Layer indices of each pipeline rank (all of its virtual stages), for the estimate.

    'auto' spreads layers as evenly as possible over `pp * interleave` stages, stage s on rank
    s % pp; explicit specs (lists of layer-range strings or index lists per stage) as written.
    """
    chunks = pp * interleave
    if spec in (None, "auto") or not isinstance(spec, list):
        base, extra = divmod(num_layers, chunks)
        bounds, start = [], 0
        for s in range(chunks):
            size = base + (1 if s < extra else 0)
            bounds.append(list(range(start, start + size)))
            start += size
    else:
        bounds = [_parse_stage(item) for item in spec]
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for s, layers in enumerate(bounds):
        ranks[s % pp].extend(layers)
    return ranks


def _parse_stage(item: Any) -> list[int]:
    if isinstance(item, list):
        return [int(x) for x in item]
    out: list[int] = []
    for part in str(item).split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def plan_lines(cfg: TrainConfig, world_size: int, *, log: Callable[[str], None] | None = None) -> list[str]:
    """Human-readable plan of `cfg` on `world_size` processes (raises ValueError when impossible)."""
    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size)
    lines = [
        f"mesh ({world_size} ranks): "
        + " x ".join(f"{n}={s}" for n, s in zip(dims.MESH_DIMS, dims.mesh_shape(), strict=True))
    ]
    views = [
        f"data {dims.dp} (replicas {dims.dp_replicate} x shards {dims.dp_shard})",
        f"dense FSDP over {dims.dense_shard_size}"
        + (f" x {dims.dense_replicas} replicas" if dims.dense_replicas > 1 else ""),
    ]
    if dims.ep > 1:
        views.append(
            f"experts over ep {dims.ep} x expert-FSDP {dims.expert_shard}"
            + (f" (x{dims.expert_replicas} replicas)" if dims.expert_replicas > 1 else "")
        )
    if dims.cp > 1:
        views.append(f"CP {par.cp_method()} {dims.cp}")
    if dims.tp > 1:
        views.append(f"TP+SP {dims.tp}")
    if dims.pp > 1:
        views.append(
            f"PP {dims.pp} ({par.pipeline_parallel_schedule}, {par.pipeline_parallel_interleave_num} chunk(s) per rank)"
        )
    lines.append("groups: " + "; ".join(views))
    accum = cfg.training.accumulation_steps(dims.dp)
    local = int(cfg.training.local_batch_size)
    seq = cfg.train_dataset.seq_length()
    batch = f"global batch {dims.dp * local * accum} = dp {dims.dp} x local {local} x accumulation {accum}"
    if dims.pp > 1:
        batch += f" (= pipeline micro-batches per step: {accum})"
    if seq:
        batch += f"; sequence {seq}" + (f" ({int(seq) // dims.cp} tokens per CP rank)" if dims.cp > 1 else "")
    lines.append(batch)
    try:
        family, counts = count_parameters(cfg, log=log)
    except Exception as exc:  # noqa: BLE001 - the plan stays useful without the memory estimate
        lines.append(f"memory: not estimated ({exc})")
        return lines
    lines += memory_lines(cfg, dims, family, counts)
    lines += reference_cost(cfg, dims, counts).lines(cfg.training.pref_loss)
    lines += activation_lines(cfg, dims, counts, log=log)
    return lines


def reference_cost(cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts) -> ReferenceCost:
    """What the reference model of `training.stage: dpo` costs each rank (parallel/plan_preference.py)."""
    pbytes = _DTYPE_BYTES.get(cfg.model.params_dtype.lower(), 4)
    copy = [p * pbytes for p in rank_parameters(cfg, dims, counts)]
    return ReferenceCost.of(cfg, copy, lora=counts.adapters is not None)


def memory_lines(cfg: TrainConfig, dims: ParallelDims, family: str, counts: ParamCounts) -> list[str]:
    """Per-rank weight/gradient/AdamW bytes of the rank with the most training state."""
    dtype = cfg.model.params_dtype.lower()
    worst = max(rank_state(cfg, dims, counts), key=lambda s: s.total)
    expert_total = sum(counts.experts)
    model = f"model: {family}, {counts.total / 1e9:.3f}B parameters" + (
        f" ({expert_total / 1e9:.3f}B in routed experts)" if expert_total else ""
    )
    sizes = (
        f"weights {worst.weights / _GIB:.2f} GiB + gradients {worst.gradients / _GIB:.2f} GiB + "
        f"AdamW {worst.optimizer / _GIB:.2f} GiB = {worst.total / _GIB:.2f} GiB"
    )
    adapters = counts.adapters
    if adapters is None:
        return [
            model,
            f"memory per rank (most loaded pipeline rank, {dtype} weights): {worst.parameters / 1e6:.1f}M "
            f"parameters -> {sizes} (training state; activations below)",
        ]
    return [
        model + f"; LoRA r={adapters.rank} on {adapters.targets} linears: "
        f"{adapters.total / 1e6:.3f}M adapter parameters train, the base is frozen",
        f"memory per rank (most loaded pipeline rank, {_frozen_dtype(cfg)} frozen base + {dtype} "
        f"adapters): {worst.parameters / 1e6:.1f}M parameters, {worst.trainable / 1e6:.3f}M of them "
        f"adapters -> {sizes} (gradients and AdamW of the adapters only; training state; activations below)",
    ]


def _frozen_dtype(cfg: TrainConfig) -> str:
    """The dtype a LoRA run keeps its frozen base in: the compute dtype (apply_lora casts to it)."""
    return (cfg.model.compute_dtype or cfg.model.params_dtype).lower()


@dataclass(frozen=True)
class RankState:
    """Training state of one rank of a pipeline stage (parameters in elements, the rest in bytes)."""

    parameters: float  # every parameter the rank holds (a LoRA run: base and adapters)
    trainable: float  # those with gradients and optimizer state
    weights: float
    gradients: float
    optimizer: float  # AdamW: two fp32 moments per trainable parameter

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def rank_state(cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts) -> list[RankState]:
    """Training state of one rank of each pipeline stage, after TP, FSDP and EP sharding.

    Full training: weights and gradients in ``params_dtype``, AdamW for every parameter. LoRA:
    the frozen base in the compute dtype, the adapters in ``params_dtype``, gradients and AdamW
    for the adapters alone.
    """
    pbytes = _DTYPE_BYTES.get(cfg.model.params_dtype.lower(), 4)
    base = rank_parameters(cfg, dims, counts)
    if counts.adapters is None:
        return [RankState(p, p, p * pbytes, p * pbytes, p * 8) for p in base]
    frozen = _DTYPE_BYTES.get(_frozen_dtype(cfg), pbytes)
    return [
        RankState(p + a, a, p * frozen + a * pbytes, a * pbytes, a * 8)
        for p, a in zip(base, rank_adapters(cfg, dims, counts), strict=True)
    ]


def _rank_layers(cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts) -> list[list[int]]:
    """Each pipeline rank's layers; the MTP blocks go with the last stage (its norm and head)."""
    par = cfg.parallelism
    decoder = len(counts.layers) - counts.mtp_layers
    ranks = stage_layers(
        decoder, dims.pp, int(par.pipeline_parallel_interleave_num), par.pipeline_parallel_layers_per_stage
    )
    ranks[-1].extend(range(decoder, len(counts.layers)))
    return ranks


def rank_parameters(cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts) -> list[float]:
    """Parameters held by one rank of each pipeline stage (after TP, FSDP and EP sharding).

    The base model's: a LoRA run's adapters are `rank_adapters`.
    """
    out = []
    for rank, layers in enumerate(_rank_layers(cfg, dims, counts)):
        dense = sum(counts.layers[i] for i in layers if i < len(counts.layers))
        experts = sum(counts.experts[i] for i in layers if i < len(counts.experts))
        if rank == 0:
            dense += counts.embedding
        if rank == dims.pp - 1:
            dense += counts.other
            # A tied head is the embedding itself on one rank, a copy on a separate last stage.
            if not counts.tied or dims.pp > 1:
                dense += counts.head
            # MTP blocks read the embedding: a separate last stage holds a copy (a tied head is it).
            if counts.mtp_layers and dims.pp > 1 and not counts.tied:
                dense += counts.embedding
        out.append(dense / (dims.tp * dims.dense_shard_size) + experts / (dims.ep * dims.expert_shard))
    return out


def rank_adapters(cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts) -> list[float]:
    """Adapter parameters held by one rank of each pipeline stage (0 without LoRA).

    The TP-split half of each adapter is divided by tp, the half each TP rank keeps whole is not;
    both are sharded over the dense FSDP group (`plan_lora`).
    """
    adapters = counts.adapters
    ranks = _rank_layers(cfg, dims, counts)
    if adapters is None:
        return [0.0] * len(ranks)
    out = []
    for rank, layers in enumerate(ranks):
        parts = [adapters.layers.get(i, (0, 0)) for i in layers]
        if rank == dims.pp - 1:
            parts += [adapters.head, adapters.other]
        split = sum(p[0] for p in parts)
        whole = sum(p[1] for p in parts)
        out.append((split / dims.tp + whole) / dims.dense_shard_size)
    return out


def in_flight(schedule: str, *, pp: int, rank: int, micro_batches: int, interleave: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak (in whole-stage units).

    No pipeline: one (each micro-batch's backward runs before the next forward). GPipe: all of
    them. 1F1B: ``pp - rank`` (rank 0 warms up with the most). Interleaved and zero-bubble
    schedules count chunk forwards: torch's warm-up of ``(chunks - 1) * pp + 2 * (pp - 1 - rank)``
    plus the first steady forward, each one chunk of the rank's layers.
    """
    if pp == 1:
        return 1.0
    from meshforge.parallel.pipeline.layout import canonical_schedule

    name = canonical_schedule(schedule)
    if name == "gpipe":
        return float(micro_batches)
    if name == "1f1b":
        return float(min(micro_batches, pp - rank))
    ops = min(micro_batches * interleave, (interleave - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return ops / interleave


@dataclass(frozen=True)
class RankActivations:
    """One pipeline rank's predicted activation bytes and training state at its peak."""

    rank: int
    num_layers: int
    in_flight: float
    device_bytes: float
    host_bytes: float
    state_bytes: float

    @property
    def peak_bytes(self) -> float:
        return self.state_bytes + self.device_bytes


def activation_plan(
    cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts, estimate: ActivationEstimate
) -> list[RankActivations]:
    """Scale one micro-batch's measured activations to each pipeline rank of the layout."""
    par = cfg.parallelism
    accum = cfg.training.accumulation_steps(dims.dp)
    interleave = int(par.pipeline_parallel_interleave_num)
    # The head's logits are vocabulary-sharded only under loss parallelism.
    outside = estimate.outside / (dims.tp if dims.tp > 1 and par.enable_loss_parallel else 1)
    rows = []
    reference = reference_cost(cfg, dims, counts).device_bytes  # a dpo run's frozen copy
    ranks = zip(_rank_layers(cfg, dims, counts), rank_state(cfg, dims, counts), strict=True)
    for rank, (layers, state) in enumerate(ranks):
        flight = in_flight(
            par.pipeline_parallel_schedule, pp=dims.pp, rank=rank, micro_batches=accum, interleave=interleave
        )
        device = sum(estimate.layers[i].device for i in layers if i in estimate.layers) / dims.tp
        host = sum(estimate.layers[i].host for i in layers if i in estimate.layers) / dims.tp
        if rank == dims.pp - 1:
            device += outside
        state_bytes = state.total + reference[rank]
        rows.append(RankActivations(rank, len(layers), flight, device * flight, host * flight, state_bytes))
    return rows


def activation_lines(
    cfg: TrainConfig, dims: ParallelDims, counts: ParamCounts, *, log: Callable[[str], None] | None = None
) -> list[str]:
    """Measured activation bytes of the most loaded rank (`device_peak.peak_lines` gives its peak)."""
    seq = cfg.train_dataset.seq_length()
    if not seq:
        return ["activations: not estimated (no sequence length: set the loader's seq_length)"]
    micro = int(cfg.training.local_batch_size)
    tokens = int(seq) // dims.cp
    try:
        estimate = measure_plan_activations(cfg, micro, tokens, log=log)
    except NotImplementedError as exc:
        return [f"activations: not estimated ({exc})"]
    except Exception as exc:  # noqa: BLE001 - the plan stays useful without the activation estimate
        return [f"activations: not estimated ({type(exc).__name__}: {exc})"]
    top = max(activation_plan(cfg, dims, counts, estimate), key=lambda r: r.peak_bytes)
    modes = f"recompute {cfg.recompute.mode}, swap {'on' if cfg.swap.enable else 'off'}"
    loss = estimate.loss
    notes = "".join(f"; {note}" for note in estimate.notes)
    where = f"pipeline rank {top.rank}" if dims.pp > 1 else "every rank"
    line = (
        f"activations per rank (micro-batch {micro} x {tokens} tokens, {modes}, {loss}; measured on fake "
        f"tensors{notes}): {where}: {top.num_layers} layers"
        + (f" / tp {dims.tp}" if dims.tp > 1 else "")
        + (f" x {top.in_flight:g} micro-batches in flight" if dims.pp > 1 else "")
        + f" = {top.device_bytes / _GIB:.2f} GiB"
        + (f" (+ {top.host_bytes / _GIB:.2f} GiB swapped to host)" if top.host_bytes else "")
    )
    return [line]


def measure_plan_activations(
    cfg: TrainConfig, micro: int, tokens: int, *, log: Callable[[str], None] | None = None
) -> ActivationEstimate:
    """One micro-batch ``[micro, tokens]`` of the configured model traced with its memory settings."""
    import torch

    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.memory.apply import ActivationSettings
    from meshforge.memory.estimate import measure_activations
    from meshforge.utils.dtype import parse_dtype

    source = resolve_model_source(cfg.model, log=log)
    params_dtype = parse_dtype(cfg.model.params_dtype, key="model.params_dtype")
    dtype = parse_dtype(cfg.model.compute_dtype, key="model.compute_dtype", default=params_dtype)
    with torch.device("meta"):  # built once: the loss rule asks the model, then it is traced
        model = source.family.build(source.options)
    lm_loss = plan_lm_loss(cfg, model)
    prepare = None
    if cfg.lora_config is not None:
        from meshforge.lora.apply import apply_lora
        from meshforge.lora.settings import lora_settings

        settings = lora_settings(cfg.lora_config)

        def prepare(traced: nn.Module) -> None:
            apply_lora(traced, settings, adapter_dtype=params_dtype)

    estimate = measure_activations(
        lambda: model,
        ActivationSettings(cfg.recompute, cfg.recompute_comm, cfg.swap),
        micro_batch=micro,
        seq=tokens,
        dtype=dtype,
        chunk_loss_size=cfg.kernels.chunk_loss_size,
        mtp=cfg.training.mtp_loss_scaling_factor > 0,
        lm_loss=lm_loss,
        prepare=prepare,
    )
    return estimate


def plan_lm_loss(cfg: TrainConfig, model: nn.Module) -> LMLoss:
    """The loss formulation a run of ``cfg`` trains ``model`` with, by the trainer's own rule.

    Eager: compiling the loss steps changes no saved tensor.
    """
    from meshforge.loss.lm import select_lm_loss
    from meshforge.models.common.kernels import fused_loss_on, supports_hidden_output

    kernels = cfg.kernels
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    vocab_size = int(weight.shape[0]) if weight is not None else None
    fused = fused_loss_on(
        kernels.fused_linear_cross_entropy,
        vocab_size=vocab_size,
        chunk_loss_size=kernels.chunk_loss_size,
        loss_parallel=cfg.parallelism.tensor_parallel > 1 and cfg.parallelism.enable_loss_parallel,
        hidden_output=supports_hidden_output(model),
    )
    return select_lm_loss(fused=fused, chunk_loss_size=kernels.chunk_loss_size, vocab_size=vocab_size)


def layout_model_issues(cfg: TrainConfig, world_size: int) -> list[tuple[str, str]]:
    """The model's divisibility rules against the layout, as `train` meets them while it builds.

    Tensor parallelism splits heads, KV heads, MLP widths and the vocabulary; the family's own TP
    plan names the first size the degree does not divide (`model.num_attention_heads (4) is not
    divisible by parallelism.tensor_parallel (3)`). Built on the meta device, as the memory plan is.
    """
    import torch

    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.models.common.tp_plan import DivisibilityError

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if dims.tp == 1:
        return []
    source = resolve_model_source(cfg.model)
    spec = source.family
    if spec.tp_plan is None:
        if spec.pattern_tp_plan is None:
            return [
                ("parallelism.tensor_parallel", f"not supported yet: tensor_parallel > 1 for {spec.name}")
            ]
        return []
    with torch.device("meta"):
        model = spec.build(source.options)
    try:
        spec.tp_plan(model, tp=dims.tp, sequence_parallel=True, loss_parallel=False)
    except DivisibilityError as err:
        return [(err.key, re.sub(r"^\((\d+)\)", r"\1", err.reason))]  # "(4) is" -> "4 is"
    except ValueError as err:  # another rule of the family's plan, keyed by its own message
        text = str(err)
        key = text.split(" ", 1)[0].rstrip(":")
        return [(key, text[len(key) :].lstrip(": "))]
    return []
