"""The parallel plan of a config for N processes, computed without starting any.

`meshforge config validate --world-size N` prints it: the mesh (every axis and the views the
trainer uses), the batch plan (accumulation steps, pipeline micro-batches), and an estimate
of each rank's parameter, gradient and optimizer-state memory. The model is built on the meta
device (no weights, no memory), so a 1024-rank layout of a large model is planned in seconds
on a laptop. Activations are not estimated: they depend on the sequence, recomputation and
the schedule, and are best measured (`memory_bytes` in metrics.jsonl).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshforge.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig

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
    layers: list[int]  # dense parameters of each decoder layer
    experts: list[int]  # routed-expert parameters of each decoder layer
    other: int  # final norm and anything outside the layers

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
    """Build the configured model on the meta device and count its parameters by placement."""
    import torch

    from meshforge.checkpoint.hf import resolve_model_source

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
    return source.family.name, ParamCounts(
        embedding=embedding,
        head=embedding if tied else head,
        tied=tied,
        layers=[per_layer[i][0] for i in indices],
        experts=[per_layer[i][1] for i in indices],
        other=other,
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
    return lines


def memory_lines(cfg: TrainConfig, dims: ParallelDims, family: str, counts: ParamCounts) -> list[str]:
    """Per-rank parameter/gradient/AdamW bytes of the most loaded pipeline rank."""
    par = cfg.parallelism
    dtype = cfg.model.params_dtype.lower()
    pbytes = _DTYPE_BYTES.get(dtype, 4)
    ranks = stage_layers(
        len(counts.layers),
        dims.pp,
        int(par.pipeline_parallel_interleave_num),
        par.pipeline_parallel_layers_per_stage,
    )
    worst = 0.0
    for rank, layers in enumerate(ranks):
        dense = sum(counts.layers[i] for i in layers if i < len(counts.layers))
        experts = sum(counts.experts[i] for i in layers if i < len(counts.experts))
        if rank == 0:
            dense += counts.embedding
        if rank == dims.pp - 1:
            dense += counts.other
            # A tied head is the embedding itself on one rank, a copy on a separate last stage.
            if not counts.tied or dims.pp > 1:
                dense += counts.head
        per_rank = dense / (dims.tp * dims.dense_shard_size) + experts / (dims.ep * dims.expert_shard)
        worst = max(worst, per_rank)
    weights = worst * pbytes
    grads = worst * pbytes
    adam = worst * 8  # two fp32 moments
    total = weights + grads + adam
    expert_total = sum(counts.experts)
    return [
        f"model: {family}, {counts.total / 1e9:.3f}B parameters"
        + (f" ({expert_total / 1e9:.3f}B in routed experts)" if expert_total else ""),
        f"memory per rank (most loaded pipeline rank, {dtype} weights): {worst / 1e6:.1f}M parameters -> "
        f"weights {weights / _GIB:.2f} GiB + gradients {grads / _GIB:.2f} GiB + AdamW {adam / _GIB:.2f} GiB "
        f"= {total / _GIB:.2f} GiB (activations not included)",
    ]
