"""`meshforge plan`: every layout of a config on N devices, those that fit, ranked by speed.

A candidate changes only the layout keys of the user's config (tensor, context, pipeline and
expert degrees, HSDP replicas, the pipeline schedule: 1F1B, interleaved 1F1B or interleaved zero
bubble, the micro-batch size, whole-layer recompute on or off, and torchao's tensorwise
float8 linears where the device has fp8 tensor cores and the config names no recipe); the global
batch, sequence, model and everything else stay as written. Each candidate is judged by the same
two models `config validate` prints: the per-device peak (`device_peak.stage_peaks`: training
state, activations from `plan.activation_plan`, FSDP, loss and pipeline buffers, the CUDA context
and NCCL) and the step-time model (`step_time.predict_step`). A float8 candidate's peak is the bf16
one: the trace runs the linears in the compute dtype, and torchao's casts are not modelled.

What makes it fast: the model is built on the meta device once (`workload.model_work`,
`plan.count_parameters`), and activations are traced once per recompute setting at one
micro-batch of the full sequence, then scaled linearly to each candidate's tokens per rank
(micro-batch x sequence / cp): saved activations grow with the tokens of a micro-batch (attention
saves its output and log-sum-exp, not the scores), so a DeepSeek-V3 search over hundreds of
layouts traces the model twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from meshforge.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.memory.estimate import ActivationEstimate
    from meshforge.parallel.device_peak import ModelFacts
    from meshforge.parallel.plan import ParamCounts
    from meshforge.parallel.step_time import StepPrediction
    from meshforge.parallel.workload import ModelWork
    from meshforge.utils.hardware import Hardware

_GIB = 1024**3
# Share of device memory the predicted reserved bytes (and the CUDA context and NCCL) may use: the
# allocator replay's fragmentation spans 1.02-1.22 around the 1.05 the prediction takes.
HEADROOM = 0.95


@dataclass(frozen=True)
class Layout:
    """The layout keys a candidate sets."""

    tp: int
    cp: int
    pp: int
    ep: int
    replicas: int  # HSDP replicas of the data-parallel ranks (1: every data rank shards)
    micro: int
    recompute: bool
    schedule: str = "1f1b"
    interleave: int = 1
    shard: int = -1  # data_parallel_shard when there are replicas
    quant: str | None = None  # model.quant_recipe_name (float8 linears), as written or tensorwise

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"cp {self.cp}", f"pp {self.pp}"]
        if self.pp > 1:
            parts[-1] += f" {self.schedule}" + (f" x{self.interleave}" if self.interleave > 1 else "")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.replicas > 1:
            parts.append(f"hsdp {self.replicas}")
        parts.append(f"micro {self.micro}")
        parts.append("recompute full" if self.recompute else "no recompute")
        if self.quant:
            parts.append(f"float8 {self.quant}")
        return ", ".join(parts)

    def overrides(self, num_layers: int) -> dict[str, dict[str, object]]:
        """Section -> the keys this layout sets (`num_layers`: the decoder layers recompute covers)."""
        model: dict[str, dict[str, object]] = (
            {"model": {"quant_recipe_name": self.quant}} if self.quant else {}
        )
        return model | {
            "parallelism": {
                "tensor_parallel": self.tp,
                "context_parallel": self.cp,
                "pipeline_parallel": self.pp,
                "expert_parallel": self.ep,
                "data_parallel_shard": -1 if self.replicas == 1 else self.shard,
                "pipeline_parallel_schedule": self.schedule,
                "pipeline_parallel_interleave_num": self.interleave,
                "pipeline_parallel_layers_per_stage": "auto",
            },
            "training": {"local_batch_size": self.micro},
            "recompute": (
                {"mode": "full", "full_recompute_layer": [f"0-{num_layers - 1}"]}
                if self.recompute
                else {"mode": "None", "full_recompute_layer": None}
            ),
        }


@dataclass
class Ranked:
    layout: Layout
    peak_bytes: float
    prediction: StepPrediction


@dataclass
class SearchResult:
    """What the search found, and enough about what it refused to explain a refusal."""

    ranked: list[Ranked] = field(default_factory=list)  # fitting layouts, fastest first
    too_big: list[Ranked] = field(default_factory=list)  # valid layouts over the memory limit
    invalid: int = 0  # candidates the degrees, batch or model rules exclude
    own: Ranked | None = None  # the config as written, when its layout is valid here
    seconds: float = 0.0
    limit_bytes: float = 0.0
    num_layers: int = 0  # decoder layers (what whole-layer recompute lists)


def _divisors(n: int, cap: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (cap is None or d <= cap)]


def own_layout(cfg: TrainConfig, world_size: int) -> Layout:
    par = cfg.parallelism
    full = cfg.recompute.mode == "full"
    dims = ParallelDims.from_config(par, world_size)
    return Layout(
        tp=par.tensor_parallel,
        cp=par.context_parallel,
        pp=par.pipeline_parallel,
        ep=par.expert_parallel,
        replicas=dims.dp_replicate,
        shard=dims.dp_shard,
        micro=int(cfg.training.local_batch_size),
        recompute=full,
        schedule=par.pipeline_parallel_schedule,
        interleave=par.pipeline_parallel_interleave_num,
        quant=cfg.model.quant_recipe_name,
    )


def candidates(
    cfg: TrainConfig,
    world_size: int,
    work: ModelWork,
    hw: Hardware,
    *,
    micro_batches: tuple[int, ...] = (1, 2, 4),
) -> Iterator[Layout]:
    """Every layout worth pricing for `world_size` devices (the config's own first, when valid)."""
    try:
        yield own_layout(cfg, world_size)
    except ValueError:
        pass
    seq = int(cfg.train_dataset.seq_length() or 0)
    decoder = len(work.layers) - work.num_mtp
    experts = {round(layer.top_k / layer.active) for layer in work.layers if layer.top_k}
    node = hw.devices_per_node
    cps = [c for c in (1, 2, 4, 8) if seq % (2 * c) == 0 and seq // c >= 1024] or [1]
    # Float8 linears as written; torchao's tensorwise recipe as well where the device has fp8
    # tensor cores and the config asks for none.
    written: str | None = cfg.model.quant_recipe_name
    recipes: list[str | None] = [written] + (["tensorwise"] if written is None and hw.fp8_flops else [])
    for tp in _divisors(world_size, cap=node):
        for cp in cps:
            for pp in _divisors(world_size // (tp * cp), cap=max(1, decoder // 2)):
                rest = world_size // (tp * cp * pp)
                for replicas in sorted({1, *(r for r in _divisors(rest) if rest // r >= node)}):
                    shard = rest // replicas
                    eps = [1]
                    if experts:
                        eps = [e for e in _divisors(shard * cp) if all(n % e == 0 for n in experts)]
                    for ep in eps:
                        schedules = [("1f1b", 1)]
                        if pp > 1:
                            # Not zbv: its V placement puts the last stage (head and loss) on pipeline
                            # rank 0, and the memory plan places stages round-robin.
                            schedules += [("interleaved1f1b", 2), ("interleavedzerobubble", 2)]
                        for schedule, interleave in schedules:
                            if pp * interleave > decoder:
                                continue
                            for micro in micro_batches:
                                for recompute in (False, True):
                                    for quant in recipes:
                                        yield Layout(
                                            tp,
                                            cp,
                                            pp,
                                            ep,
                                            replicas,
                                            micro,
                                            recompute,
                                            schedule,
                                            interleave,
                                            shard,
                                            quant,
                                        )


def apply_layout(cfg: TrainConfig, layout: Layout, num_layers: int) -> TrainConfig:
    """`cfg` with the layout's keys set (checked by the caller through ParallelDims)."""
    from meshforge.memory.config import RecomputeConfig

    sections = layout.overrides(num_layers)
    par = cfg.parallelism.model_copy(update=sections["parallelism"])
    training = cfg.training.model_copy(update=sections["training"])
    recompute = RecomputeConfig.model_validate(sections["recompute"])
    model = cfg.model.model_copy(update={"quant_recipe_name": layout.quant})
    return cfg.model_copy(
        update={"parallelism": par, "training": training, "recompute": recompute, "model": model}
    )


class _Activations:
    """One traced micro-batch per recompute setting, scaled to a candidate's tokens per rank."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] | None) -> None:
        self._log = log
        self._traced: dict[bool, ActivationEstimate] = {}
        self._seq = int(cfg.train_dataset.seq_length() or 0)

    def estimate(self, cfg: TrainConfig, layout: Layout) -> ActivationEstimate:
        from meshforge.memory.estimate import ActivationEstimate, LayerBytes
        from meshforge.parallel.plan import measure_plan_activations

        if layout.recompute not in self._traced:
            self._traced[layout.recompute] = measure_plan_activations(cfg, 1, self._seq, log=self._log)
        base = self._traced[layout.recompute]
        scale = layout.micro / layout.cp
        return ActivationEstimate(
            layers={
                i: LayerBytes(int(b.device * scale), int(b.host * scale), b.formula)
                for i, b in base.layers.items()
            },
            outside=int(base.outside * scale),
            notes=base.notes,
            loss=base.loss,
        )


def search(
    cfg: TrainConfig,
    world_size: int,
    hw: Hardware,
    *,
    memory_gib: float | None = None,
    log: Callable[[str], None] | None = None,
) -> SearchResult:
    """Price every candidate layout; keep those whose predicted peak fits the device."""
    from meshforge.parallel.device_peak import model_facts
    from meshforge.parallel.plan import count_parameters, layout_model_issues
    from meshforge.parallel.step_time import predict_step
    from meshforge.parallel.workload import model_work

    started = time.perf_counter()
    work = model_work(cfg, log=log)
    _family, counts = count_parameters(cfg, log=log)
    num_layers = len(counts.layers) - counts.mtp_layers
    activations = _Activations(cfg, log)
    facts = model_facts(cfg, work, log=log)
    result = SearchResult(limit_bytes=(memory_gib or hw.memory_gib) * _GIB * HEADROOM, num_layers=num_layers)
    result.own = _as_written(cfg, world_size, hw, work, counts, log)
    tp_ok: dict[int, bool] = {}
    seen: set[Layout] = set()
    for layout in candidates(cfg, world_size, work, hw):
        if layout in seen:
            continue
        seen.add(layout)
        trial = apply_layout(cfg, layout, num_layers)
        try:
            dims = ParallelDims.from_config(trial.parallelism, world_size)
            accum = trial.training.accumulation_steps(dims.dp)
        except ValueError:
            result.invalid += 1
            continue
        if dims.pp > 1 and (accum < dims.pp or (layout.interleave > 1 and accum % dims.pp)):
            result.invalid += 1
            continue
        if layout.tp not in tp_ok:
            tp_ok[layout.tp] = not layout_model_issues(trial, world_size)
        if not tp_ok[layout.tp]:
            result.invalid += 1
            continue
        rebuilt = None
        if layout.recompute:  # what a recomputed layer rebuilds: the layer traced without recompute
            plain = replace(layout, recompute=False)
            rebuilt = activations.estimate(apply_layout(cfg, plain, num_layers), plain)
        peak = _peak(
            trial,
            dims,
            counts,
            _facts_for(facts, layout.recompute),
            activations.estimate(trial, layout),
            rebuilt,
        )
        prediction = predict_step(
            trial, world_size, hw, work=_with_recompute(work, layout.recompute), counts=counts
        )
        entry = Ranked(layout, peak, prediction)
        (result.ranked if peak <= result.limit_bytes else result.too_big).append(entry)
    result.ranked.sort(key=lambda r: -r.prediction.tokens_per_device)
    result.seconds = time.perf_counter() - started
    return result


def _as_written(
    cfg: TrainConfig,
    world_size: int,
    hw: Hardware,
    work: ModelWork,
    counts: ParamCounts,
    log: Callable[[str], None] | None,
) -> Ranked | None:
    """The config's own layout and recompute, priced as `config validate` prices it."""
    from meshforge.parallel.device_peak import model_facts, trace_estimates
    from meshforge.parallel.step_time import predict_step

    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
        cfg.training.accumulation_steps(dims.dp)
    except ValueError:
        return None
    estimate, rebuilt = trace_estimates(cfg, dims, log=log)
    return Ranked(
        own_layout(cfg, world_size),
        _peak(cfg, dims, counts, model_facts(cfg, work, log=log), estimate, rebuilt),
        predict_step(cfg, world_size, hw, work=work, counts=counts),
    )


def _peak(
    cfg: TrainConfig,
    dims: ParallelDims,
    counts: ParamCounts,
    facts: ModelFacts,
    estimate: ActivationEstimate,
    rebuilt: ActivationEstimate | None,
) -> float:
    """The highest steady-state peak over the pipeline stages (`device_peak`): what the caching
    allocator reserves plus the CUDA context and NCCL buffers (`DevicePeak.device_total`)."""
    from meshforge.parallel.device_peak import stage_peaks

    return max(p.device_total for p in stage_peaks(cfg, dims, counts, facts, estimate, rebuilt))


def _facts_for(facts: ModelFacts, full: bool) -> ModelFacts:
    """The model's facts with whole-layer recompute on every layer, or none."""
    return replace(facts, recomputed=[1.0 if full else 0.0] * len(facts.recomputed))


def _with_recompute(work: ModelWork, full: bool) -> ModelWork:
    """The model's work with whole-layer recompute on every layer, or none."""
    layers = [
        replace(layer, recompute=1.0 if full else 0.0, recompute_attention=full) for layer in work.layers
    ]
    return replace(work, layers=layers)
