"""What one rank's device holds at the peak of a training step, component by component.

Why: the saved-for-backward ledger (`plan.activation_plan`) plus the training state misses what a
step holds besides them: FSDP2's unsharded parameters (the root's embedding and head all step,
the current and the prefetched layer, a pipeline stage's every layer since it never reshards),
the unsharded gradient of the layer in backward and its reduce-scatter copy in the reduce dtype
(a pipeline stage accumulates the whole stage's unsharded gradients over its micro-batches), the
layer that recompute rebuilds, the gradients flowing through a layer's backward, the loss's
float32 softmax gradient over ``[tokens, vocab]`` (a chunk of it for the chunked and fused
losses), the inputs tensor parallelism's sequence parallel gathers whole, and the expert
dispatch buffers. On tiny layouts the ledger alone predicted about half of what a step holds
(`train/dry_run.py` measures it on fake tensors; `benchmarks/device_peak_calibration.py`).

A step's memory peaks in one of four places, and the prediction is the largest of them:

* ``loss``: the last stage at the loss's backward, every micro-batch in flight saved, the
  loss's ``[tokens, vocab]`` float32 gradients alive;
* ``backward``: the first layer backward of the stage (the logits freed), the rebuilt layer and
  the gradients flowing through it alive, its unsharded gradients and reduce-scatter buffer;
* ``embedding backward`` (first stage, no pipeline): the end of backward, every sharded gradient
  there and the root's unsharded gradients (one per use of a weight, and a copy) alive;
* ``optimizer``: parameters, gradients and the AdamW moments (no activations).

Not modelled: float8's casts (a float8 run is predicted as its compute dtype) and optimizers
other than AdamW (Muon's one momentum is counted as two moments). A dpo run's frozen reference
copy is `reference` (`parallel/plan_preference.py`); a reward model's value head holds no logits.

``allocated`` is the steady state (the optimizer's moments exist through forward and backward,
as from the second step on): what decides whether a run fits. ``first_step`` is the first step,
whose moments appear at its optimizer step (torch creates them lazily): what a one-step dry run
measures. Both count what the caching allocator hands out (no fragmentation). ``reserved`` is
what it maps (its fragmentation of the compute stream's pool, as the dry run's allocator replay
measures it, and FSDP2's collective streams' own pools: the gathered weights and the sharded
gradients); ``overhead`` (the CUDA context and NCCL's buffers, outside the allocator and unseen by
a fake-tensor tracker) is kept apart, and ``device_total`` adds it to ``reserved``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from meshforge.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.memory.estimate import ActivationEstimate
    from meshforge.parallel.plan import ParamCounts
    from meshforge.parallel.workload import ModelWork

_GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
# The CUDA context and cuBLAS workspaces of a process (not allocator memory).
CUDA_CONTEXT_BYTES = 0.6 * _GIB
# NCCL's channel buffers per communicator a rank joins (one per mesh dimension above 1).
NCCL_BYTES_PER_GROUP = 0.15 * _GIB
# Gradients flowing through one layer's backward, as a share of what the layer saves without
# recompute: the gradient of each intermediate lives while the next one is computed.
BACKWARD_WORKING_SHARE = 0.5
# The compute stream's reserved bytes over its live high-water mark under expandable segments,
# replayed from the dry runs of the real-size examples (train/allocator_replay.py;
# benchmarks/dry_run_examples.py): 1.02-1.22 over the five, the median (1.047).
FRAGMENTATION = 1.05
# The components a caching allocator hands out (`DevicePeak.allocated` adds them up).
DEVICE_COMPONENTS = (
    "params",
    "grads",
    "optimizer",
    "unsharded_params",
    "unsharded_grads",
    "activations",
    "rebuilt",
    "working",
    "loss",
    "pipeline",
    "dispatch",
    "reference",
)


@dataclass(frozen=True)
class DevicePeak:
    """One rank's predicted peak, in bytes per component (the components of the peak's phase)."""

    rank: int  # global rank modelled (the first rank of its pipeline stage)
    stage: int  # pipeline rank
    world_size: int
    phase: str  # where the step peaks: "loss", "backward" or "optimizer"
    params: float = 0.0  # sharded weights (a LoRA run: frozen base + adapters)
    grads: float = 0.0  # sharded gradients alive at the peak
    optimizer: float = 0.0  # AdamW's two moments (the steady state; 0 before the first step's update)
    unsharded_params: float = 0.0  # FSDP all-gather outputs alive (root, current/prefetched layers)
    unsharded_grads: float = 0.0  # unsharded gradients and reduce-scatter buffers alive
    activations: float = 0.0  # saved for backward, every micro-batch in flight (SP inputs whole)
    rebuilt: float = 0.0  # the layer recompute rebuilds for its backward
    working: float = 0.0  # gradients flowing through the layer in backward
    loss: float = 0.0  # the loss's float32 [tokens, vocab] gradients (or one chunk's)
    pipeline: float = 0.0  # stage-boundary send/receive buffers
    dispatch: float = 0.0  # expert-parallel all-to-all buffers of one MoE layer
    reference: float = 0.0  # a dpo run's frozen reference copy (parallel/plan_preference.py)
    host: float = 0.0  # swapped activations and CPU-offloaded state in host memory (not on the device)
    overhead: float = 0.0  # CUDA context + NCCL buffers (outside the caching allocator)
    first_step: float = 0.0  # the first step's peak (moments created at its update)
    in_flight: float = 1.0  # micro-batches whose activations the stage holds at the peak
    # FSDP2's collective streams' pools (their own cached blocks): the all-gather buffers and the
    # reduced gradients; `grads` above lives in them.
    collective_pools: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def allocated(self) -> float:
        """The steady-state peak the caching allocator hands out (the device components)."""
        return float(sum(getattr(self, name) for name in DEVICE_COMPONENTS))

    @property
    def reserved(self) -> float:
        """What the caching allocator maps at the peak: the compute stream's share of
        ``allocated`` with its fragmentation, plus FSDP2's collective streams' pools."""
        if not self.collective_pools:
            return self.allocated * FRAGMENTATION
        return (self.allocated - self.grads) * FRAGMENTATION + max(self.collective_pools, self.grads)

    @property
    def device_total(self) -> float:
        """``reserved`` plus the CUDA context and NCCL buffers: what the device must hold."""
        return self.reserved + self.overhead

    def components(self) -> dict[str, float]:
        """Name -> bytes of every non-zero device component (they add up to ``allocated``)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in DEVICE_COMPONENTS and getattr(self, f.name)
        }

    def describe(self) -> str:
        """One line: the total and its largest components in GiB."""
        parts = sorted(self.components().items(), key=lambda kv: -kv[1])
        shown = " + ".join(
            f"{name.replace('_', ' ')} {value / _GIB:.2f}" for name, value in parts if value >= 0.005 * _GIB
        )
        return f"{self.allocated / _GIB:.2f} GiB at {self.phase} ({shown or 'all under 0.01 GiB'})"


@dataclass(frozen=True)
class ModelFacts:
    """What the peak model reads off the model besides its parameter counts."""

    hidden: int
    vocab: int
    top_k: list[int]  # experts per token of each layer (0: dense)
    recomputed: list[float]  # share of each layer recomputed in backward
    hidden_output: bool  # the model can feed the chunked and fused losses


def model_facts(
    cfg: TrainConfig, work: ModelWork | None = None, log: Callable[[str], None] | None = None
) -> ModelFacts:
    """Hidden size, vocabulary, experts per token and recompute coverage of the configured model."""
    import torch

    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.models.common.kernels import supports_hidden_output
    from meshforge.parallel.workload import model_work

    work = work or model_work(cfg, log=log)
    source = resolve_model_source(cfg.model, log=log)
    with torch.device("meta"):
        hidden_output = supports_hidden_output(source.family.build(source.options))
    return ModelFacts(
        hidden=work.hidden,
        vocab=work.vocab,
        top_k=[layer.top_k for layer in work.layers],
        recomputed=[layer.recompute for layer in work.layers],
        hidden_output=hidden_output,
    )


def _bytes(name: str | None, default: int) -> int:
    return _DTYPE_BYTES.get((name or "").lower(), default)


def _loss_transient(
    cfg: TrainConfig, dims: ParallelDims, facts: ModelFacts, tokens: int, cbytes: int
) -> tuple[float, str]:
    """Bytes the loss holds besides what it saves (last stage), and the loss's name."""
    from meshforge.loss.lm import select_lm_loss
    from meshforge.models.common.kernels import fused_loss_on

    if cfg.training.stage == "rm":
        # The value head reads each sequence's last hidden state: no [tokens, vocab] logits.
        return 0.0, "reward head on each sequence's last token"
    par = cfg.parallelism
    loss_parallel = dims.tp > 1 and par.enable_loss_parallel
    fused = fused_loss_on(
        cfg.kernels.fused_linear_cross_entropy,
        vocab_size=facts.vocab,
        chunk_loss_size=cfg.kernels.chunk_loss_size,
        loss_parallel=loss_parallel,
        hidden_output=facts.hidden_output,
    )
    lm = select_lm_loss(fused=fused, chunk_loss_size=cfg.kernels.chunk_loss_size, vocab_size=facts.vocab)
    vocab = facts.vocab / (dims.tp if loss_parallel else 1)
    if lm.mode == "logits":
        if loss_parallel:
            # Its forward holds the head's logits and their float32 copy while it builds the
            # saved softmax; its backward one float32 `softmax - one_hot`.
            return max(4.0, cbytes + (4.0 if cbytes != 4 else 0.0)) * tokens * vocab, lm.describe()
        # nll's float32 gradient and log-softmax's (the saved log-softmax is in the ledger).
        return 2.0 * tokens * vocab * 4, lm.describe()
    chunk = min(tokens, int(lm.chunk_size or tokens))
    # One chunk's float32 logits and their log-softmax (or gradient).
    return 2.0 * chunk * vocab * 4, lm.describe()


def stage_peaks(
    cfg: TrainConfig,
    dims: ParallelDims,
    counts: ParamCounts,
    facts: ModelFacts,
    estimate: ActivationEstimate,
    rebuilt: ActivationEstimate | None,
) -> list[DevicePeak]:
    """The peak of one rank of every pipeline stage.

    Args:
        estimate: One micro-batch's saved bytes at the rank's shapes with the run's settings.
        rebuilt: The same without recompute (what a recomputed layer rebuilds); None when the
            run recomputes nothing.
    """
    from meshforge.parallel.plan import _rank_layers, activation_plan, rank_state, reference_cost

    par = cfg.parallelism
    pbytes = _bytes(cfg.model.params_dtype, 4)
    cbytes = _bytes(cfg.model.compute_dtype, pbytes)
    rbytes = _bytes(par.reduce_dtype, 4)
    micro = int(cfg.training.local_batch_size)
    seq = int(cfg.train_dataset.seq_length() or 0)
    tokens = micro * seq // dims.cp  # one micro-batch on this rank (sequence-parallel ranks split it by tp)
    accum = cfg.training.accumulation_steps(dims.dp)
    fsdp = dims.needs_fsdp
    keep_unsharded = (
        dims.pp > 1
        if par.reshard_after_forward_policy == "default"
        else par.reshard_after_forward_policy == "never"
    )
    loss_bytes, loss_name = _loss_transient(cfg, dims, facts, tokens, cbytes)
    lora = counts.adapters is not None
    groups = sum(1 for size in (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) if size > 1)
    overhead = CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP * groups
    rows = activation_plan(cfg, dims, counts, estimate)
    states = rank_state(cfg, dims, counts)
    reference = reference_cost(cfg, dims, counts).device_bytes
    out: list[DevicePeak] = []
    for stage, (layers, state, row) in enumerate(
        zip(_rank_layers(cfg, dims, counts), states, rows, strict=True)
    ):
        last = stage == dims.pp - 1
        root = (counts.embedding if stage == 0 else 0) + (
            (counts.other + (0 if counts.tied and dims.pp == 1 else counts.head)) if last else 0
        )
        train_share = (state.trainable / state.parameters) if (lora and state.parameters) else 1.0
        # One layer's unsharded parameters: dense ones split by tp, its experts by ep.
        sizes = [
            counts.layers[i] / dims.tp + counts.experts[i] / dims.ep for i in layers if i < len(counts.layers)
        ]
        # The root's head (and final norm) gets its gradient first in backward and keeps it
        # unsharded until the root's reduce-scatter at the end of backward.
        head_grad = (root - (counts.embedding if stage == 0 else 0)) / dims.tp if last else 0.0
        if counts.tied and dims.pp == 1:
            head_grad = root / dims.tp
        end_grads = 0.0  # the embedding's backward (first stage): the root's gradients all alive
        pools = 0.0
        if not fsdp:
            gathered, grad_buffers = 0.0, 0.0
        else:
            pair = max((a + b for a, b in zip(sizes, sizes[1:], strict=False)), default=sum(sizes))
            gathered = (root / dims.tp + (sum(sizes) if keep_unsharded else pair)) * cbytes
            # The all-gather stream keeps the largest gathered buffers (the root's, or the pair of
            # layers in flight); the reduce-scatter stream the sharded gradients and the largest
            # unit's reduced output in the reduce dtype.
            largest_unit = max(root / dims.tp, max(sizes, default=0.0))
            pools = max(root / dims.tp, pair) * cbytes + (
                state.gradients + largest_unit / dims.dense_shard_size * rbytes * train_share
            )
            if dims.pp > 1:
                # Gradient sync is off until the last micro-batch: the stage's unsharded gradients
                # accumulate in the reduce dtype (a copy when it is not the compute dtype).
                acc_bytes = rbytes if rbytes != cbytes else cbytes
                grad_buffers = (
                    (sum(sizes) + root / dims.tp) * acc_bytes + max(sizes, default=0.0) * cbytes
                ) * train_share
            else:
                layer_grad = max(sizes, default=0.0) * (cbytes + (rbytes if rbytes != cbytes else 0))
                grad_buffers = (layer_grad + head_grad * cbytes) * train_share
                if stage == 0:
                    # Each use of a weight (a tied one: the head and the embedding) gives its own
                    # gradient before they are summed, and the reduce-scatter takes one more copy.
                    copies = 2 + (1 if counts.tied else 0)
                    end_grads = root / dims.tp * cbytes * copies * train_share
        grads_alive = state.gradients if (accum > 1 or dims.pp > 1) else 0.0
        moments = 2.0 * state.gradients  # AdamW: exp_avg and exp_avg_sq in the parameters' dtype
        flight = row.in_flight
        # Sequence parallel saves the gathered (whole-sequence) inputs of the attention and MLP
        # projections; the ledger's bytes were divided by tp as a whole.
        sp_layer = 2.0 * tokens * facts.hidden * cbytes * (1 - 1 / dims.tp)
        sp_extra = sum(sp_layer * (1 - facts.recomputed[i]) for i in layers if i < len(facts.recomputed))
        saved = row.device_bytes + sp_extra * flight
        # What the trace saved outside the layers (the head's logits and the loss's saved softmax):
        # held at the loss; a reward model's value head saves no logits.
        outside = (
            (estimate.outside / (dims.tp if dims.tp > 1 and par.enable_loss_parallel else 1)) if last else 0.0
        )
        at_loss = saved - (outside if cfg.training.stage == "rm" else 0.0)
        full_layer = sp_layer + max(
            (
                (rebuilt or estimate).layers[i].device / dims.tp
                for i in layers
                if i in (rebuilt or estimate).layers
            ),
            default=0.0,
        )
        rebuild = 0.0
        if rebuilt is not None:
            rebuild = max(
                (
                    (rebuilt.layers[i].device / dims.tp + sp_layer) * facts.recomputed[i]
                    for i in layers
                    if i in rebuilt.layers and i < len(facts.recomputed)
                ),
                default=0.0,
            )
        pipe = 2.0 * tokens * facts.hidden * cbytes / dims.tp if dims.pp > 1 else 0.0
        dispatch = 0.0
        if dims.ep > 1:
            top_k = max((facts.top_k[i] for i in layers if i < len(facts.top_k)), default=0)
            dispatch = 2.0 * tokens / dims.tp * top_k * facts.hidden * cbytes
        base = DevicePeak(
            rank=stage * (dims.world_size // dims.pp),
            stage=stage,
            world_size=dims.world_size,
            phase="backward",
            params=state.weights,
            grads=grads_alive,
            optimizer=moments,
            unsharded_params=gathered,
            unsharded_grads=grad_buffers,
            activations=saved - outside,
            rebuilt=rebuild,
            working=BACKWARD_WORKING_SHARE * full_layer,
            pipeline=pipe,
            dispatch=dispatch,
            reference=reference[stage],
            host=row.host_bytes,
            overhead=overhead,
            in_flight=flight,
            collective_pools=pools,
            notes=[loss_name] + list(estimate.notes),
        )
        phases = [base]
        if last:
            phases.append(
                replace(
                    base,
                    phase="loss",
                    activations=at_loss,
                    # Accumulated stage gradients stay; without a pipeline none is unsharded yet.
                    unsharded_grads=base.unsharded_grads if dims.pp > 1 else 0.0,
                    rebuilt=0.0,
                    working=0.0,
                    dispatch=0.0,
                    loss=loss_bytes,
                )
            )
        if end_grads:
            phases.append(
                replace(
                    base,
                    phase="embedding backward",
                    grads=state.gradients,
                    unsharded_params=gathered if keep_unsharded else root / dims.tp * cbytes,
                    unsharded_grads=end_grads,
                    activations=0.0,
                    rebuilt=0.0,
                    working=0.0,
                    pipeline=0.0,
                    dispatch=0.0,
                )
            )
        optimizer_phase = DevicePeak(
            rank=base.rank,
            stage=stage,
            world_size=dims.world_size,
            phase="optimizer",
            params=state.weights,
            grads=state.gradients,
            optimizer=moments,
            reference=reference[stage],
            host=row.host_bytes,
            overhead=overhead,
            in_flight=flight,
            collective_pools=pools,
            notes=base.notes,
        )
        if par.cpu_offload and fsdp:
            # FSDP's CPU offload keeps the sharded state in host memory (the update runs there).
            on_host = state.weights + state.gradients + moments
            phases = [replace(p, params=0.0, grads=0.0, optimizer=0.0, host=p.host + on_host) for p in phases]
            optimizer_phase = replace(
                optimizer_phase, params=0.0, grads=0.0, optimizer=0.0, host=optimizer_phase.host + on_host
            )
        steady = max([*phases, optimizer_phase], key=lambda p: p.allocated)
        first = max([p.allocated - p.optimizer for p in phases] + [optimizer_phase.allocated])
        out.append(replace(steady, first_step=first))
    return out


def trace_estimates(
    cfg: TrainConfig, dims: ParallelDims, *, log: Callable[[str], None] | None = None
) -> tuple[ActivationEstimate, ActivationEstimate | None]:
    """One micro-batch of the rank traced with the run's settings, and without recompute when it has any."""
    from meshforge.memory.config import RecomputeConfig
    from meshforge.parallel.plan import measure_plan_activations

    seq = int(cfg.train_dataset.seq_length() or 0)
    if not seq:
        raise ValueError("no sequence length: set the loader's seq_length")
    micro = int(cfg.training.local_batch_size)
    estimate = measure_plan_activations(cfg, micro, seq // dims.cp, log=log)
    if cfg.recompute.mode == "None":
        return estimate, None
    plain = cfg.model_copy(update={"recompute": RecomputeConfig()})
    return estimate, measure_plan_activations(plain, micro, seq // dims.cp, log=log)


def predict_device_peak(
    cfg: TrainConfig,
    world_size: int,
    rank: int | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> DevicePeak:
    """The predicted peak of `rank` (None: the rank of the stage with the highest peak).

    Raises:
        ValueError: the layout is impossible, or the config has no sequence length.
    """
    from meshforge.parallel.plan import count_parameters

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    _family, counts = count_parameters(cfg, log=log)
    facts = model_facts(cfg, log=log)
    estimate, rebuilt = trace_estimates(cfg, dims, log=log)
    peaks = stage_peaks(cfg, dims, counts, facts, estimate, rebuilt)
    if rank is None:
        return max(peaks, key=lambda p: p.allocated)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank}: must be in 0..{world_size - 1}")
    stage = rank // (world_size // dims.pp)
    return replace(peaks[stage], rank=rank)


def peak_lines(cfg: TrainConfig, world_size: int, *, log: Callable[[str], None] | None = None) -> list[str]:
    """`config validate`'s predicted-peak line (and one per pipeline rank when there are several).

    Empty when the plan could not estimate the parameters or the activations (its own lines say
    why). With `context.max_device_memory` set, the line says whether the peak, CUDA context and
    NCCL included, fits.
    """
    from meshforge.parallel.plan import count_parameters

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    try:
        _family, counts = count_parameters(cfg, log=log)
        estimate, rebuilt = trace_estimates(cfg, dims, log=log)
        peaks = stage_peaks(cfg, dims, counts, model_facts(cfg, log=log), estimate, rebuilt)
    except Exception:  # noqa: BLE001 - the plan's own lines name what could not be estimated
        return []
    top = max(peaks, key=lambda p: p.allocated)
    where = f"pipeline rank {top.stage}" if dims.pp > 1 else "every rank"
    state = top.params + top.grads + top.optimizer
    saved = top.activations + top.rebuilt
    buffers = top.allocated - state - saved
    parts = {
        k: v
        for k, v in top.components().items()
        if k not in ("params", "grads", "optimizer", "activations", "rebuilt")
    }
    detail = ", ".join(
        f"{k.replace('_', ' ')} {v / _GIB:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
    )
    verdict = ""
    if "max_device_memory" in cfg.context.model_fields_set:
        limit = cfg.context.max_device_memory
        fits = top.device_total <= float(limit.strip().upper()[:-2]) * 1e9
        verdict = f"; {'fits' if fits else 'does NOT fit'} context.max_device_memory {limit}"
    lines = [
        f"predicted peak per rank ({where}): state {state / _GIB:.2f} GiB + activations {saved / _GIB:.2f} GiB "
        f"+ buffers {buffers / _GIB:.2f} GiB = {top.allocated / _GIB:.2f} GiB allocated at {top.phase}"
        + (f" (buffers: {detail})" if detail else "")
        + f", first step {top.first_step / _GIB:.2f} GiB; {top.reserved / _GIB:.2f} GiB reserved by the caching "
        f"allocator + {top.overhead / _GIB:.2f} GiB CUDA context and NCCL = {top.device_total / _GIB:.2f} GiB "
        f"on the device{verdict}"
    ]
    if dims.pp > 1:
        lines.append(
            "predicted peak by pipeline rank: "
            + ", ".join(f"{p.stage}: {p.allocated / _GIB:.2f} GiB at {p.phase}" for p in peaks)
        )
    return lines
