"""How long one training step of a layout takes on hardware this machine does not have.

A roofline-style model with the overlap rules meshforge's own parallel code has:

- **compute**: the step's FLOPs on the most loaded pipeline rank (`parallel.workload`: matmuls
  by weight, attention products over the causal context, the recompute's extra forward, a LoRA
  run's missing weight gradients) at the device's matmul peak times an achieved-efficiency
  factor per operation class (dense GEMMs, grouped expert GEMMs, attention), plus the memory-bound
  elementwise work (norms, activations, rotary) at memory bandwidth, less of it compiled;
- **communication**: every collective the layout issues, priced as a ring on the link its mesh
  dimension spans (NVLink inside a node, the NIC across nodes): FSDP's all-gathers and
  reduce-scatters (hidden behind compute by its prefetch, except the first gather and what
  compute cannot cover), HSDP's all-reduce, TP+SP's per-layer gathers and scatters, CP's key and
  value exchange, EP's token all-to-alls and PP's activation sends (exposed: meshforge issues
  these on the compute stream);
- **pipeline bubble**: the schedule's idle micro-batch slots (1F1B and GPipe ``pp - 1``,
  interleaved ``(pp - 1) / chunks``, zero-bubble a third of that);
- **optimizer**: AdamW's pass over the rank's fp32 state at memory bandwidth.

The efficiency factors are fitted to published runs (`benchmarks/step_time_calibration.py`,
benchmarks/README.md), never to torchtitan's tables, which stay an independent check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshforge.parallel.dims import ParallelDims
from meshforge.utils.hardware import Hardware

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.parallel.plan import ParamCounts
    from meshforge.parallel.workload import LayerWork, ModelWork

_GIB = 1024**3
_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the table's peaks (fitted; see the module docstring).

    Attributes:
        matmul: Dense GEMMs at large width.
        matmul_width: GEMM width (hidden / tp) at which dense efficiency is half of ``matmul``.
        experts: Grouped expert GEMMs at many tokens per expert.
        expert_tokens: Tokens per expert and micro-batch at which expert efficiency is half of
            ``experts`` (fine-grained experts get few rows each).
        attention: Attention kernels over the causal work.
        float8: Factor on top of ``matmul`` when linears run in float8 (scaling and casts).
        link: Bus efficiency of a ring collective.
        overlap: Share of compute time that FSDP's prefetched traffic can hide behind.
        elementwise_eager: Bytes moved per token and hidden unit by one layer's non-matmul ops,
            eager, counted on a Llama layer: two RMSNorms in fp32 (about 60 each), rotary on q
            and k, SwiGLU on the 3.5x-wide MLP (about 21), residual adds (12), about 150 in
            forward and twice that in backward.
        elementwise_compiled: The same under ``kernels.compile``: fused, each tensor read and
            written about once (a third).
        adapter_bytes: Bytes a low-rank adapter moves per token and feature of the linear it
            wraps (forward, input gradient, weight gradients), all memory-bound.
        optimizer_bytes: Bytes AdamW reads and writes per trainable parameter (fp32 state and
            gradient, the norm for clipping).
    """

    matmul: float = 0.58
    matmul_width: float = 128.0
    experts: float = 0.8
    expert_tokens: float = 256.0
    attention: float = 0.5
    float8: float = 0.7
    link: float = 0.8
    overlap: float = 0.9
    elementwise_eager: float = 450.0
    elementwise_compiled: float = 150.0
    adapter_bytes: float = 16.0
    optimizer_bytes: float = 32.0


MEASURED = Efficiency(
    matmul=1.0, matmul_width=0.0, experts=1.0, expert_tokens=0.0, attention=1.0, float8=1.0, link=1.0
)


@dataclass(frozen=True)
class Collective:
    """One kind of traffic of a step on one rank."""

    dim: str  # mesh dimension in words: "fsdp", "expert fsdp", "replicate", "tp", "cp", "ep", "pp"
    kind: str  # "all-gather + reduce-scatter", "all-to-all", ...
    bytes: float  # bytes each rank sends per step
    seconds: float
    crosses_nodes: bool
    hidden: bool  # overlapped with compute by meshforge's schedule


@dataclass
class StepPrediction:
    """One step of the most loaded rank, split the way the printed line reads."""

    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    tokens_per_step: float
    world_size: int
    model_flops_per_token: float
    peak_flops: float
    collectives: list[Collective] = field(default_factory=list)
    rank: int = 0

    @property
    def step(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer

    @property
    def tokens_per_device(self) -> float:
        return self.tokens_per_step / self.step / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_device / self.peak_flops

    def bottleneck(self) -> str:
        """The largest part of the step, in words."""
        parts = {
            "compute": self.compute,
            "exposed communication": self.exposed_comm,
            "pipeline bubble": self.bubble,
            "optimizer": self.optimizer,
        }
        name = max(parts, key=lambda k: parts[k])
        if name == "exposed communication" and self.collectives:
            worst = max((c for c in self.collectives if not c.hidden), key=lambda c: c.seconds, default=None)
            if worst is not None:
                return f"{worst.dim} {worst.kind}" + (" across nodes" if worst.crosses_nodes else "")
        return name


def _group_shape(size: int, stride: int, hw: Hardware) -> tuple[int, int]:
    """Members of a group of `size` ranks `stride` apart that share a node, and its node count."""
    local = max(1, min(size, hw.devices_per_node // max(stride, 1)))
    return local, max(1, size // local)


def _transfer_seconds(
    pattern: str, total: float, size: int, stride: int, hw: Hardware, eff: Efficiency
) -> float:
    """Time of one collective over `total` bytes (the whole tensor) on a group's links.

    A ring all-gather or reduce-scatter across nodes moves each other node's share into a node
    once, through the NICs of the group's members there, while NVLink forwards it inside; the two
    run together (NCCL's rings pipeline them), so the slower one sets the time. An all-to-all
    sends every rank's own distinct data through its own NIC. A send/recv is one link.
    """
    intra = hw.intra_node_bandwidth * eff.link
    inter = hw.inter_node_bandwidth * eff.link
    local, nodes = _group_shape(size, stride, hw)
    if pattern == "ring":
        inside = total * (size - 1) / size / intra
        across = total * (nodes - 1) / nodes / (local * inter) if nodes > 1 else 0.0
        return max(inside, across)
    if pattern == "all-to-all":
        sent = total * (size - 1) / size
        off_node = (size - local) / (size - 1) if size > 1 else 0.0
        return max(sent * (1 - off_node) / intra, sent * off_node / inter)
    return total / (inter if nodes > 1 else intra)


def _causal_context(seq: int, window: int | None) -> float:
    """Mean keys a query attends under a causal mask, a sliding window narrowing it."""
    span = min(seq, window or seq)
    return span - span * span / (2.0 * seq)


@dataclass(frozen=True)
class _Layout:
    """The facts of a config and world size the pricing reads."""

    dims: ParallelDims
    seq: int
    micro: int
    accum: int
    compute_bytes: int
    reduce_bytes: int
    float8: bool
    compiled: bool
    lora: bool
    reshard: bool
    schedule: str
    interleave: int
    cp_method: str

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch on one rank group (before TP splits the work)."""
        return self.micro * self.seq / self.dims.cp


def _layout(cfg: TrainConfig, world_size: int, *, device: str) -> _Layout:
    from meshforge.parallel.pipeline.layout import canonical_schedule

    par = cfg.parallelism
    dims = ParallelDims.from_config(par, world_size)
    seq = cfg.train_dataset.seq_length()
    if not seq:
        raise ValueError("no sequence length: set the loader's seq_length")
    params = cfg.model.params_dtype.lower()
    compute = (cfg.model.compute_dtype or cfg.model.params_dtype).lower()
    reduce = compute if not cfg.optimizer.accumulate_allreduce_grads_in_fp32 else par.reduce_dtype.lower()
    policy = par.reshard_after_forward_policy
    compile_on = cfg.kernels.compile
    return _Layout(
        dims=dims,
        seq=int(seq),
        micro=int(cfg.training.local_batch_size),
        accum=cfg.training.accumulation_steps(dims.dp),
        compute_bytes=_BYTES.get(compute, 4),
        reduce_bytes=_BYTES.get(reduce, _BYTES.get(params, 4)),
        float8=cfg.model.quant_recipe_name is not None,
        compiled=compile_on is True or (compile_on == "auto" and device != "cpu"),
        lora=cfg.lora_config is not None,
        reshard=(dims.pp == 1) if policy == "default" else policy == "always",
        schedule=canonical_schedule(par.pipeline_parallel_schedule) if dims.pp > 1 else "none",
        interleave=int(par.pipeline_parallel_interleave_num),
        cp_method=par.cp_method(),
    )


def _stage_layers(work: ModelWork, lay: _Layout, cfg: TrainConfig) -> list[list[int]]:
    from meshforge.parallel.plan import stage_layers

    decoder = len(work.layers) - work.num_mtp
    par = cfg.parallelism
    ranks = stage_layers(decoder, lay.dims.pp, lay.interleave, par.pipeline_parallel_layers_per_stage)
    ranks[-1].extend(range(decoder, len(work.layers)))
    return ranks


def _layer_seconds(layer: LayerWork, lay: _Layout, hw: Hardware, eff: Efficiency, hidden: int) -> float:
    """Compute time of one layer for one micro-batch on one rank (forward, backward, recompute)."""
    dims = lay.dims
    tokens = lay.tokens / dims.tp
    weight_passes = 2.0 if lay.lora else 3.0  # a frozen weight needs no weight gradient
    passes = weight_passes + layer.recompute
    peak_mm = hw.peak_flops("bf16" if lay.compute_bytes == 2 else "fp32", float8=lay.float8)
    width = hidden / dims.tp
    shape = width / (width + eff.matmul_width) if eff.matmul_width else 1.0
    scale = eff.float8 if lay.float8 and hw.fp8_flops is not None else 1.0
    dense = tokens * 2.0 * layer.dense * passes / (peak_mm * eff.matmul * shape * scale)
    per_expert = tokens * layer.active
    rows = per_expert / (per_expert + eff.expert_tokens) if eff.expert_tokens and per_expert else 1.0
    experts = tokens * 2.0 * layer.experts * layer.active * passes / (peak_mm * eff.experts * rows * scale)
    peak_attn = hw.peak_flops("bf16" if lay.compute_bytes == 2 else "fp32")
    attn_passes = 3.0 + (1.0 if layer.recompute_attention else 0.0)
    attention = sum(
        tokens * core.forward_flops(_causal_context(lay.seq, core.window)) * attn_passes
        for core in layer.attention
    ) / (peak_attn * eff.attention)
    per_unit = eff.elementwise_compiled if lay.compiled else eff.elementwise_eager
    elementwise = tokens * hidden * per_unit * (1.0 + layer.recompute) / hw.memory_bandwidth
    adapters = (
        tokens * layer.linear_io / dims.tp * eff.adapter_bytes / hw.memory_bandwidth if lay.lora else 0.0
    )
    return dense + experts + attention + elementwise + adapters


def _head_seconds(work: ModelWork, lay: _Layout, hw: Hardware, eff: Efficiency) -> float:
    passes = 2.0 if lay.lora else 3.0
    peak = hw.peak_flops("bf16" if lay.compute_bytes == 2 else "fp32")
    heads = 1 + work.num_mtp
    return heads * lay.tokens / lay.dims.tp * 2.0 * work.head * passes / (peak * eff.matmul)


def _collectives(
    work: ModelWork, layers: list[int], rank: int, lay: _Layout, hw: Hardware, eff: Efficiency
) -> list[Collective]:
    """Every kind of traffic one rank of pipeline stage `rank` issues in a step.

    Each entry is priced per call on the whole tensor and multiplied by its calls per step.
    """
    dims = lay.dims
    m = lay.accum
    cb, rb = lay.compute_bytes, lay.reduce_bytes
    out: list[Collective] = []

    def add(dim: str, kind: str, pattern: str, calls: float, total: float, size: int, stride: int) -> None:
        if calls <= 0 or total <= 0 or size <= 1:
            return
        sent = calls * total * ((size - 1) / size if pattern != "send/recv" else 1.0)
        seconds = calls * _transfer_seconds(pattern, total, size, stride, hw, eff)
        crosses = _group_shape(size, stride, hw)[1] > 1
        out.append(Collective(dim, kind, sent, seconds, crosses, dim in _OVERLAPPED))

    stage = [work.layers[i] for i in layers]
    dense = sum(layer.dense for layer in stage) / dims.tp
    if rank == 0:
        dense += work.head / dims.tp  # the input embedding (the head's size)
    if rank == dims.pp - 1:
        dense += work.head * (1 + work.num_mtp) / dims.tp
    experts = sum(layer.experts for layer in stage) / max(dims.ep, 1)
    gathers = m * (2 if lay.reshard else 1)
    scatters = 0 if lay.lora else m  # a LoRA run reduces only its adapters' gradients
    n, e, r = dims.dense_shard_size, dims.expert_shard, dims.dp_replicate
    expert_stride = dims.tp * dims.cp * dims.dp_shard_in_ep
    add("fsdp", "all-gather", "ring", gathers, dense * cb, n, dims.tp)
    add("fsdp", "reduce-scatter", "ring", scatters, dense * rb, n, dims.tp)
    add("expert fsdp", "all-gather", "ring", gathers, experts * cb, e, expert_stride)
    add("expert fsdp", "reduce-scatter", "ring", scatters, experts * rb, e, expert_stride)
    replicate_stride = dims.tp * dims.cp * dims.dp_shard
    add("replicate", "all-reduce", "ring", 2 * scatters, (dense / n + experts / e) * rb, r, replicate_stride)
    activation = lay.tokens * work.hidden * cb
    recompute = sum(layer.recompute for layer in stage)
    add(
        "tp",
        "all-gather + reduce-scatter",
        "ring",
        m * (8 * len(stage) + 4 * recompute),
        activation,
        dims.tp,
        1,
    )
    if dims.cp > 1:
        for layer in stage:
            passes = m * (2 + (1 if layer.recompute_attention else 0))
            for core in layer.attention:
                if lay.cp_method in ("ulysses", "hybrid"):
                    elems = core.heads * (2 * core.qk_dim + 2 * core.v_dim)
                    add(
                        "cp",
                        "all-to-all",
                        "all-to-all",
                        passes,
                        lay.tokens * elems * cb / dims.tp,
                        dims.cp,
                        dims.tp,
                    )
                else:  # keys and values gathered from every CP rank, their gradients scattered back
                    whole = lay.tokens * core.kv_elements() * cb / dims.tp * dims.cp
                    add("cp", "key/value all-gather", "ring", passes, whole, dims.cp, dims.tp)
    for layer in stage:
        if layer.top_k:
            routed = lay.tokens / dims.tp * layer.top_k * work.hidden * cb
            add("ep", "all-to-all", "all-to-all", m * (4 + 2 * layer.recompute), routed, dims.ep, dims.tp)
    pp_stride = dims.tp * dims.cp * dims.dp_shard * dims.dp_replicate
    add("pp", "send/recv", "send/recv", m * 2 * lay.interleave, activation / dims.tp, dims.pp, pp_stride)
    return _merged(out)


_OVERLAPPED = frozenset({"fsdp", "expert fsdp", "replicate"})


def _merged(collectives: list[Collective]) -> list[Collective]:
    """One entry per mesh dimension and kind."""
    merged: dict[tuple[str, str], Collective] = {}
    for c in collectives:
        key = (c.dim, c.kind)
        if key in merged:
            old = merged[key]
            c = Collective(
                c.dim, c.kind, old.bytes + c.bytes, old.seconds + c.seconds, c.crosses_nodes, c.hidden
            )
        merged[key] = c
    return list(merged.values())


def _bubble_share(lay: _Layout) -> float:
    """Idle micro-batch slots of the schedule, in units of one micro-batch's stage compute."""
    pp = lay.dims.pp
    if pp == 1:
        return 0.0
    if lay.schedule in ("1f1b", "gpipe"):
        return float(pp - 1)
    share = (pp - 1) / lay.interleave
    if lay.schedule in ("interleavedzerobubble", "zbv"):
        share /= 3.0
    return share


def predict_step(
    cfg: TrainConfig,
    world_size: int,
    hw: Hardware,
    *,
    work: ModelWork | None = None,
    counts: ParamCounts | None = None,
    eff: Efficiency | None = None,
    log: Callable[[str], None] | None = None,
) -> StepPrediction:
    """Predict one step of `cfg` on `world_size` devices of kind `hw` (its slowest rank)."""
    from meshforge.parallel.plan import count_parameters, rank_state
    from meshforge.parallel.workload import model_work

    if eff is None:
        eff = MEASURED if hw.measured else Efficiency()
    lay = _layout(cfg, world_size, device=hw.name)
    work = work if work is not None else model_work(cfg, log=log)
    if counts is None:
        _family, counts = count_parameters(cfg, log=log)
    states = rank_state(cfg, lay.dims, counts)
    best: StepPrediction | None = None
    for rank, layers in enumerate(_stage_layers(work, lay, cfg)):
        per_micro = sum(_layer_seconds(work.layers[i], lay, hw, eff, work.hidden) for i in layers)
        if rank == lay.dims.pp - 1:
            per_micro += _head_seconds(work, lay, hw, eff)
        compute = per_micro * lay.accum
        collectives = _collectives(work, layers, rank, lay, hw, eff)
        hidden_comm = sum(c.seconds for c in collectives if c.hidden)
        first_gather = hidden_comm / max(len(layers), 1) / max(lay.accum, 1)
        exposed = sum(c.seconds for c in collectives if not c.hidden)
        exposed += max(0.0, hidden_comm - eff.overlap * compute) + (first_gather if hidden_comm else 0.0)
        state = states[min(rank, len(states) - 1)]
        optimizer = state.trainable * eff.optimizer_bytes / hw.memory_bandwidth
        prediction = StepPrediction(
            compute=compute,
            exposed_comm=exposed,
            bubble=_bubble_share(lay) * per_micro,
            optimizer=optimizer,
            tokens_per_step=lay.dims.dp * lay.micro * lay.accum * lay.seq,
            world_size=world_size,
            model_flops_per_token=work.model_flops_per_token(lay.seq),
            peak_flops=hw.peak_flops("bf16" if lay.compute_bytes == 2 else "fp32"),
            collectives=collectives,
            rank=rank,
        )
        if best is None or prediction.step > best.step:
            best = prediction
    assert best is not None
    return best


def _human(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def throughput_lines(prediction: StepPrediction, hw: Hardware) -> list[str]:
    """The `config validate --device` lines: the throughput, then the traffic of the step."""
    p = prediction
    where = f" (pipeline rank {p.rank})" if p.rank else ""
    mfu = "" if hw.measured else f"MFU {100 * p.mfu:.1f}%; "
    lines = [
        f"predicted throughput on {hw.title}: {p.tokens_per_device:,.0f} tokens/s per device "
        f"({mfu}step {_human(p.step)} = compute {_human(p.compute)} + exposed "
        f"communication {_human(p.exposed_comm)} + pipeline bubble {_human(p.bubble)} + optimizer "
        f"{_human(p.optimizer)}){where}; bound by {p.bottleneck()}"
    ]
    if p.collectives:
        parts = [
            f"{c.dim} {c.kind} {c.bytes / _GIB:.2f} GiB {'across nodes' if c.crosses_nodes else 'in node'} "
            f"{_human(c.seconds)}{' (overlapped)' if c.hidden else ''}"
            for c in p.collectives
        ]
        lines.append("communication per step and rank: " + "; ".join(parts))
    return lines
