"""One whole training step of one rank of an N-rank layout, on fake tensors in this process.

Why: a 256-rank layout's shapes, placements, uneven shards, DTensor redistributions and
pipeline boundaries are only exercised by launching it. Here the same build and step code the
trainer runs (`build_model`'s parallelisation in its fixed order, FSDP2, TP/SP, CP, EP, the PP
schedule, recompute, LoRA, the optimizer and the DCP save plan) runs for rank R against torch's
fake process group (every collective returns at once, with its output unchanged) with
`FakeTensorMode` tensors (shapes, dtypes and placements, no values). Memory is what a caching
allocator would see, tracked by torch's `MemTracker` (allocations and frees), and what it would
reserve, those allocations replayed through its placement rules (`train/allocator_replay.py`:
fragmentation, one pool per stream, with `--device` the device's capacity); every collective is
recorded with its mesh dimension and buffer size. The preference stages' batch is made on the
host and its values kept beside the fakes (`utils/fake_values.py`).

The fake tensors live on the CPU device type when this torch has no CUDA runtime (FSDP2's
CUDA streams and events need it), so CUDA-only kernels (flash attention, float8 matmuls) are
not what runs; on a CUDA build the target device type is used.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from meshforge.train.allocator_replay import AllocatorReplay, streams_routed
from meshforge.train.dry_run_record import (
    CollectiveRecorder,
    CollectiveRow,
    ModuleTracker,
    group_dims,
    new_step_peak,
    peak_total,
)

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.config import TrainConfig
    from meshforge.parallel.device_peak import DevicePeak
    from meshforge.parallel.dims import ParallelDims
    from meshforge.train.run import ModelParts

Batch = dict[str, torch.Tensor]
Log = Callable[[str], None]


@dataclass(frozen=True)
class DryRunReport:
    """What one dry-run step of one rank found."""

    rank: int
    world_size: int
    device: str  # the target named by the user (h100, ...) or the device type
    device_type: str  # what the fake tensors were created on
    seconds: float
    peak_bytes: int
    collectives: list[CollectiveRow]
    save_plan_items: int
    predicted_peak_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    # The caching allocator's mapped bytes (train/allocator_replay.py): all streams, then the
    # compute stream's mapped bytes, its live high-water mark, and the collective streams' bytes.
    reserved_bytes: int = 0
    reserved_split: tuple[int, int, int] = (0, 0, 0)
    predicted_reserved_bytes: float | None = None  # DevicePeak.reserved
    # With --device: what the allocator may map there, its cache releases, where it ran out.
    capacity: int | None = None
    retries: int = 0
    out_of_memory_at: int | None = None

    def _fit_line(self) -> str:
        """Whether the step fits the device, by the allocator replay with its capacity."""
        gib = 1024**3
        room = f"{self.device}: {(self.capacity or 0) / gib:.1f} GiB for the allocator after the CUDA context and NCCL"
        if self.out_of_memory_at is not None:
            return (
                f"  on {room}: OUT OF MEMORY, {self.out_of_memory_at / gib:.2f} GiB in use when the pages "
                "in use no longer fit"
            )
        if self.retries:
            return (
                f"  on {room}: fits once the allocator releases its cached pages ({self.retries} "
                "retries in the step, each a device synchronisation)"
            )
        return f"  on {room}: fits ({((self.capacity or 0) - self.reserved_bytes) / gib:.2f} GiB to spare)"

    def lines(self) -> list[str]:
        """The printed report: the headline, the reserved bytes (and, with a device, whether the
        step fits it), then one line per mesh dimension's collectives."""
        gib = 1024**3
        head = (
            f"dry run (rank {self.rank} of {self.world_size}, {self.device}): one step ok in "
            f"{self.seconds:.1f} s; measured peak {self.peak_bytes / gib:.2f} GiB"
        )
        if self.predicted_peak_bytes:
            ratio = self.peak_bytes / self.predicted_peak_bytes
            head += f" (predicted {self.predicted_peak_bytes / gib:.2f} GiB: measured/predicted {ratio:.2f})"
        out = [head]
        if self.reserved_bytes:
            compute, live, side = self.reserved_split
            out.append(
                f"  reserved by the caching allocator (expandable segments): {self.reserved_bytes / gib:.2f} GiB "
                f"({self.reserved_bytes / max(self.peak_bytes, 1):.2f}x the peak): the compute stream "
                f"{compute / gib:.2f} for its {live / gib:.2f} GiB high-water mark, FSDP's collective streams "
                f"{side / gib:.2f}"
                + (
                    f" (predicted {self.predicted_reserved_bytes / gib:.2f} GiB)"
                    if self.predicted_reserved_bytes
                    else ""
                )
            )
        if self.capacity is not None:
            out.append(self._fit_line())
        by_dim: dict[str, list[CollectiveRow]] = {}
        for row in self.collectives:
            by_dim.setdefault(row.dim, []).append(row)
        for dim, rows in by_dim.items():
            parts = ", ".join(f"{r.kind} x{r.count} ({_human_bytes(r.bytes)})" for r in rows)
            out.append(f"  collectives on {dim}: {parts}")
        if not self.collectives:
            out.append("  collectives: none (one rank)")
        out.append(f"  checkpoint: DCP save plan of {self.save_plan_items} items on this rank")
        out.extend(f"  note: {note}" for note in self.notes)
        return out


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class DryRunError(RuntimeError):
    """The step failed: the layout, the module it failed in, and the original error."""


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group for the block (collectives do nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _VocabOnly:
    """A stand-in tokenizer of the model's vocabulary size when no tokenizer folder is at hand."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pad_token_id = 0
        self.eos_token_id = 0

    def __len__(self) -> int:
        return self.size


def _allocator_capacity(device: str | None, peak: DevicePeak | None) -> int | None:
    """The bytes the caching allocator may map on `device` (the hardware table's usable memory
    less the CUDA context and NCCL), or None without a known device."""
    from meshforge.utils.hardware import HARDWARE

    if device is None or device.lower() not in HARDWARE or device.lower() == "cpu":
        return None
    overhead = peak.overhead if peak is not None else 0.0
    return int(HARDWARE[device.lower()].memory_gib * 1024**3 - overhead)


def prediction(cfg: TrainConfig, world_size: int, rank: int | None) -> tuple[int, DevicePeak | None]:
    """The rank to run (given, or the first rank of the stage the planner predicts the highest
    peak for) and its predicted steady-state peak (`parallel/device_peak.py`); None when the
    planner cannot estimate it."""
    from meshforge.parallel.device_peak import predict_device_peak

    try:
        peak = predict_device_peak(cfg, world_size, rank)
    except Exception:  # noqa: BLE001 - the dry run stands without the comparison
        return (rank or 0), None
    return peak.rank, peak


def synthetic_batch(cfg: TrainConfig, parts: ModelParts) -> Batch:
    """One micro-batch of the configured shape (token ids of the right range; no values matter).

    The preference stages get one pair a row, as `data/sft/pairwise.py` lays it out: the chosen
    sequence in the first half (segment 1), the rejected one in the second (segment 2), positions
    restarting at each, the first quarter of each (the prompt) and its last token unlabelled.
    """
    rows = int(cfg.training.local_batch_size)
    seq = int(cfg.train_dataset.seq_length() or cfg.model.seq_length or 0)
    if seq <= 0:
        raise ValueError("a dry run needs a sequence length: set the loader's seq_length or model.seq_length")
    ids = torch.randint(0, len(parts.tokenizer), (rows, seq))
    if cfg.training.stage not in ("dpo", "rm"):
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).repeat(rows, 1)}
    half = seq // 2
    segments = torch.zeros(rows, seq, dtype=torch.long)
    segments[:, :half], segments[:, half : 2 * half] = 1, 2
    labels = torch.full_like(ids, -100)
    for start in (0, half):
        answer = slice(start + half // 4, start + half - 1)
        labels[:, answer] = ids[:, answer.start + 1 : answer.stop + 1]
    positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).repeat(rows, 1)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "segment_ids": segments}


def _fake_batch(batch: Batch, fake: FakeTensorMode, device: torch.device) -> Batch:
    """The batch as fake tensors on `device`, each keeping its host values (`utils/fake_values.py`:
    the preference stages read them to find the answer tokens)."""
    from meshforge.utils.fake_values import keep

    out: Batch = {}
    for key, host in batch.items():
        out[key] = fake.from_tensor(host).to(device)
        keep(out[key], host)
    return out


def dry_run(
    cfg: TrainConfig,
    *,
    world_size: int,
    rank: int | None = None,
    device: str | None = None,
    log: Log | None = None,
) -> DryRunReport:
    """Run one training step of `rank` (default: the planner's most loaded) of `world_size` on fake tensors.

    Raises:
        DryRunError: the step failed; the message names the layout, the module and the error.
        ValueError: a config the layout cannot run (from the build, naming the key).
    """
    from meshforge.parallel.dims import ParallelDims

    stage = cfg.training.stage
    if stage == "dpo" and cfg.training.pref_ref_logps == "precompute":
        raise NotImplementedError(
            "not supported yet: a dry run of training.pref_ref_logps: precompute (its table pass reads "
            "the data set before the first step)"
        )
    if stage in ("dpo", "rm") and cfg.parallelism.context_parallel > 1:
        raise NotImplementedError(
            f"not supported yet: a dry run of training.stage: {stage} with context parallelism (the "
            "answer tokens are found on the gathered rows, whose values fake tensors do not hold)"
        )
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank}: must be in 0..{world_size - 1}")
    rank, predicted_peak = prediction(cfg, world_size, rank)
    predicted = predicted_peak.allocated if predicted_peak is not None else None
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    sink = log or (lambda _: None)
    start = time.perf_counter()
    layout = dims.describe()
    with (
        fake_world(rank, world_size),
        tempfile.TemporaryDirectory(prefix="meshforge-dry-run-") as tmp,
        _quiet_torch(),
    ):
        tracker = ModuleTracker()
        replay = AllocatorReplay(_allocator_capacity(device, predicted_peak))
        try:
            peak, rows, items, notes = _step(cfg, dims, rank, device_type, Path(tmp), sink, tracker, replay)
        except (ValueError, NotImplementedError):
            raise
        except Exception as exc:
            where = f" in {tracker.current()}" if tracker.current() else ""
            raise DryRunError(
                f"dry run (rank {rank} of {world_size}, {layout}) failed{where}: {type(exc).__name__}: {exc}"
            ) from exc
    return DryRunReport(
        rank=rank,
        world_size=world_size,
        device=device or device_type,
        device_type=device_type,
        seconds=time.perf_counter() - start,
        peak_bytes=peak,
        collectives=rows,
        save_plan_items=items,
        predicted_peak_bytes=predicted,
        notes=notes,
        reserved_bytes=replay.reserved_peak,
        reserved_split=replay.split(),
        capacity=replay.capacity,
        retries=replay.retries,
        out_of_memory_at=replay.out_of_memory_at,
        predicted_reserved_bytes=predicted_peak.reserved if predicted_peak is not None else None,
    )


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's warnings about the step (FSDP views, sequential DTensor reductions) are the
    trainer's business at launch, not the dry run's report: silenced for the step."""
    import warnings

    dist_logger = logging.getLogger("torch.distributed")
    level = dist_logger.level
    dist_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        dist_logger.setLevel(level)


def _step(
    cfg: TrainConfig,
    dims: ParallelDims,
    rank: int,
    device_type: str,
    output_dir: Path,
    log: Log,
    tracker: ModuleTracker,
    replay: AllocatorReplay,
) -> tuple[int, list[CollectiveRow], int, list[str]]:
    """Build rank `rank`'s run on fake tensors and run one optimizer step; (peak, collectives, plan items, notes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.train.batches import plan_batches, to_device
    from meshforge.train.build import (
        build_checkpointer,
        build_grad_accumulation,
        build_optimizer,
        build_pipeline,
    )
    from meshforge.train.build_model import build_model
    from meshforge.train.build_preference import build_preference
    from meshforge.train.build_reward import build_reward
    from meshforge.train.replicas import replica_groups
    from meshforge.train.run import OptimParts, Progress, Run, RunData, RunEnv, Watchers
    from meshforge.train.trainer import Trainer
    from meshforge.utils.distributed import DistInfo, all_reduce_sum
    from meshforge.utils.fake_memory import sharding_propagation_untracked

    notes: list[str] = []
    mesh = dims.build_mesh(device_type)
    plan, _ = plan_batches(cfg.training, dims.dp * replica_groups(cfg.parallelism))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device_type)
    env = RunEnv(
        cfg,
        log,
        logging.getLogger("meshforge.dry_run"),
        DistInfo(rank=rank, world_size=dims.world_size, local_rank=0),
        device,
        dims,
        mesh,
        plan,
        output_dir,
        "",
        fake_tensors=fake,
    )
    tokenizer = _tokenizer(cfg, log, notes)
    parts = build_model(cfg, env, tokenizer)
    run_pref = build_preference(cfg, env, parts, tokenizer) or build_reward(cfg, env, parts)
    data = RunData(
        loader=cast(Any, None),  # the step's batches are synthetic; no loader is built
        eval_loaders={},
        loader_context=cast(Any, None),
        total_steps=cfg.training.steps,
        rampup=None,
    )
    with fake:
        optimizer, scheduler = build_optimizer(cfg.optimizer, cfg.lr_scheduler, parts, data)
    grad_accum = build_grad_accumulation(cfg.optimizer, parts, log)
    pipeline = build_pipeline(cfg.parallelism, env, parts)
    trainer = Trainer(cfg, log=log, check_inputs=False)
    optim = OptimParts(
        optimizer, scheduler, grad_accum, pipeline, build_checkpointer(cfg.checkpoint, env, parts)
    )
    # The dry-run step reaches no watcher (no health verdict, sinks or callbacks).
    trainer.run = Run(env, parts, data, optim, cast(Watchers, None), Progress(), preference=run_pref)
    steps = _micro_batches_to_run(plan.grad_accum_steps, pipeline, dims)
    if steps < plan.grad_accum_steps:
        notes.append(
            f"ran {steps} of the step's {plan.grad_accum_steps} micro-batches: the peak does not grow "
            "with more (accumulation adds no live activations; a pipeline's in-flight count is "
            "reached); the collectives above are those of the micro-batches run"
        )
    if pipeline is not None:
        pipeline._schedule_for(steps)  # built before the peers are simulated on every schedule
        _simulate_pipeline_peers(pipeline, cfg, dims, parts)
        notes.append(
            "pipeline: the neighbouring stages' shapes are taken as [micro-batch, sequence / cp, "
            "hidden] in the compute dtype (the ranks that would send them are not run)"
        )
    from meshforge.models.common.moe import ExpertsBase

    if any(isinstance(m, ExpertsBase) for m in parts.module.modules()):
        notes.append("MoE routing taken as balanced (fake tensors carry no router values)")
    tracker.install(parts.module)
    recorder = CollectiveRecorder(group_dims(mesh, parts.module))
    memory = new_step_peak(replay)
    # The pair stages' batches are made on the host first: their values decide the answer tokens.
    hosts = [synthetic_batch(cfg, parts) for _ in range(steps)] if run_pref is not None else []
    with fake:
        if run_pref is not None:
            micro = [_fake_batch(host, fake, device) for host in hosts]
        else:
            micro = [to_device(synthetic_batch(cfg, parts), device, pin=False) for _ in range(steps)]
        if dims.cp > 1:
            micro = [trainer._shard_for_cp(mb) for mb in micro]
        _prime_optimizer_state(parts.module, optimizer)
        memory.track_external(parts.module, optimizer)
        with (
            memory,
            recorder,
            sharding_propagation_untracked(),
            streams_routed(replay, getattr(torch, device_type)),
        ):
            count = (
                run_pref.count_pairs if run_pref is not None else (lambda mb: (mb["labels"] != -100).sum())
            )
            units = sum(count(mb) for mb in micro)
            normalizer = all_reduce_sum(
                torch.as_tensor(units, device=device), mesh.view("loss").get_group()
            ).to(torch.float32)
            trainer._aux_sum = torch.zeros((), device=device)
            trainer._mtp_sum = torch.zeros((), device=device)
            loss_sum = trainer.backward_micro_batches(micro, normalizer)
            all_reduce_sum(loss_sum / normalizer, mesh.view("loss").get_group())
            trainer.clip_grads()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    tracker.remove()
    # Outside the mode: DCP's planner makes small real tensors of its own (shard offsets); the
    # state's fake tensors still dispatch to their mode.
    items = _save_plan_items(optim, parts)
    peak = peak_total(memory.get_tracker_snapshot("peak"))
    if device_type != "cuda":
        notes.append(
            "fake tensors on the CPU device type (this torch has no CUDA runtime): CUDA-only kernels, "
            "streams and events were not exercised"
        )
    return peak, recorder.rows(), items, notes


def _micro_batches_to_run(total: int, pipeline: Any, dims: ParallelDims) -> int:
    """Enough of the step's micro-batches to reach its peak: two without a pipeline (the
    second meets the first's gradients), two rounds of the stages with one."""
    if pipeline is None:
        return min(total, 2)
    from meshforge.parallel.pipeline.runtime import check_microbatches

    fewer = 2 * pipeline.split.num_stages
    if fewer >= total:
        return total
    try:
        check_microbatches(pipeline.schedule_name, fewer, dims.pp)
    except ValueError:
        return total
    return fewer


def _simulate_pipeline_peers(pipeline: Any, cfg: TrainConfig, dims: ParallelDims, parts: ModelParts) -> None:
    """Stand in for the other pipeline ranks' half of torch's stage set-up.

    torch's schedule votes on static or dynamic shape inference and then receives each stage's
    input shapes from the previous rank (and its output-gradient shapes from the next) as
    pickled objects: the fake process group delivers nothing, so this rank's stages answer
    themselves: the activations that cross a stage boundary (hidden states, and the router
    statistics with the aux loss), and for gradients the shapes of this stage's own outputs.
    """
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_metas,
    )

    rows = int(cfg.training.local_batch_size)  # the schedule's micro-batch is the trainer's
    seq = int(cfg.train_dataset.seq_length() or cfg.model.seq_length or 0) // dims.cp
    if dims.tp > 1:
        seq //= dims.tp  # sequence parallelism (always on with TP): the hidden states stay split
    hidden_size = int(getattr(getattr(parts.module, "config", None), "hidden_size", 0) or 0)
    if not hidden_size:
        raise NotImplementedError(
            "not supported yet: a dry run of a pipeline whose model has no config.hidden_size"
        )

    def boundary() -> tuple[torch.Tensor, ...]:
        hidden = torch.empty(rows, seq, hidden_size, dtype=parts.compute_dtype, requires_grad=True)
        if pipeline.aux_experts is None:
            return (hidden,)
        carry = torch.empty(2 * pipeline.aux_experts + 1, dtype=torch.float32, requires_grad=True)
        return hidden, carry

    for stage in pipeline.stages:

        def recv(src: int, stage: Any = stage) -> object:
            if src < stage.stage_index:
                metas = extract_tensor_metas(boundary())
                assert metas is not None
                return _StageForwardMeta(forward_metas=metas)
            outputs = stage._stage_meta.outputs
            return _StageBackwardMeta(backward_metas=tuple(m if m.requires_grad else None for m in outputs))

        stage._recv_meta = recv
        stage._send_meta = lambda meta, dst: None

    def vote(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC

    for schedule in pipeline._schedules.values():
        schedule._warmup_p2p = vote


def _prime_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One untracked update on zero gradients, so the measured step is a steady-state one: the
    optimizer's state (AdamW's moments) is live through its forward and backward, as from the
    second step of a run on."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tokenizer(cfg: TrainConfig, log: Log, notes: list[str]) -> Any:
    """The run's tokenizer, or a stand-in of the model's vocabulary when its folder is absent."""
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.train.build_model import build_tokenizer

    path = cfg.model.tokenizer_name_or_path or cfg.model.model_name_or_path
    try:
        return build_tokenizer(cfg.model, log)
    except (OSError, ValueError) as exc:
        source = resolve_model_source(cfg.model, log=log)
        vocab = int(source.family.parse_options(source.options).vocab_size)
        notes.append(
            f"no tokenizer at {path!r} ({type(exc).__name__}): vocabulary {vocab} from the model config"
        )
        return _VocabOnly(vocab)


def _save_plan_items(optim: Any, parts: ModelParts) -> int:
    """Items in this rank's DCP save plan of the model and optimizer state (no file written)."""
    plan = optim.checkpointer.local_save_plan(parts.module, optim.optimizer)
    return len(plan.items)
