"""One whole training step of one rank of an N-rank layout, on fake tensors in this process.

Why: a 256-rank layout's shapes, placements, uneven shards, DTensor redistributions and
pipeline boundaries are only exercised by launching it. Here the same build and step code the
trainer runs (`build_model`'s parallelisation in its fixed order, FSDP2, TP/SP, CP, EP, the PP
schedule, recompute, LoRA, the optimizer and the DCP save plan) runs for rank R against torch's
fake process group (every collective returns at once, with its output unchanged) with
`FakeTensorMode` tensors (shapes, dtypes and placements, no values). Memory is what a caching
allocator would see, tracked by torch's `MemTracker` (allocations and frees, no fragmentation);
every collective is recorded with its mesh dimension and buffer size.

The fake tensors live on the CPU device type when this torch has no CUDA runtime (FSDP2's
CUDA streams and events need it), so CUDA-only kernels (flash attention, float8 matmuls) are
not what runs; on a CUDA build the target device type is used.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from meshforge.config import TrainConfig
    from meshforge.parallel.dims import ParallelDims, ParallelMesh
    from meshforge.train.run import ModelParts

Batch = dict[str, torch.Tensor]
Log = Callable[[str], None]

# c10d ops (eager process-group calls) and functional collectives, by the kind of transfer.
_KINDS = {
    "_allgather_base_": "all-gather",
    "allgather_": "all-gather",
    "allgather_into_tensor_coalesced_": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "all_gather_into_tensor_coalesced": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter",
    "allreduce_": "all-reduce",
    "allreduce_coalesced_": "all-reduce",
    "all_reduce": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
    "alltoall_base_": "all-to-all",
    "alltoall_": "all-to-all",
    "all_to_all_single": "all-to-all",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class CollectiveRow:
    """The collectives of one kind on one mesh dimension over the step."""

    dim: str
    kind: str
    count: int
    bytes: int


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

    def lines(self) -> list[str]:
        """The printed report: the headline, then one line per mesh dimension's collectives."""
        gib = 1024**3
        head = (
            f"dry run (rank {self.rank} of {self.world_size}, {self.device}): one step ok in "
            f"{self.seconds:.1f} s; measured peak {self.peak_bytes / gib:.2f} GiB"
        )
        if self.predicted_peak_bytes:
            ratio = self.peak_bytes / self.predicted_peak_bytes
            head += f" (predicted {self.predicted_peak_bytes / gib:.2f} GiB: measured/predicted {ratio:.2f})"
        out = [head]
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


class CollectiveRecorder(TorchDispatchMode):
    """Counts every collective op that passes, keyed by (mesh dimension, kind), with its bytes.

    The bytes of a call are its largest buffer (the gathered output of an all-gather, the input
    of a reduce-scatter, the tensor of an all-reduce), as the step-time model prices them.
    """

    def __init__(self, group_dims: dict[str, str]) -> None:
        super().__init__()
        self.group_dims = group_dims
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        result = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if namespace in ("c10d", "_c10d_functional") and name in _KINDS:
            key = (self._dim_of(args), _KINDS[name])
            self.counts[key] += 1
            self.bytes[key] += max([_tensor_bytes(a) for a in args] + [_tensor_bytes(result)])
        return result

    def _dim_of(self, args: Sequence[object]) -> str:
        # The group is the last group-like argument (functional collectives pass the reduce op
        # as a string before the group's name).
        names = [name for arg in args if (name := _group_name(arg)) is not None]
        if not names:
            return "world"
        return self.group_dims.get(names[-1], f"group {names[-1]}")

    def rows(self) -> list[CollectiveRow]:
        return [
            CollectiveRow(dim, kind, count, int(self.bytes[(dim, kind)]))
            for (dim, kind), count in sorted(self.counts.items())
        ]


def _tensor_bytes(value: object) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _group_name(arg: object) -> str | None:
    """The process-group name of a collective's argument (a boxed ProcessGroup or a name)."""
    import torch.distributed as dist

    if isinstance(arg, str):
        return arg
    if isinstance(arg, torch.ScriptObject):
        with contextlib.suppress(Exception):
            return str(dist.ProcessGroup.unbox(arg).group_name)
    if isinstance(arg, dist.ProcessGroup):
        return str(arg.group_name)
    return None


def group_dims(mesh: ParallelMesh) -> dict[str, str]:
    """Process-group name -> the mesh dimension it spans (`tp`, `fsdp:dp_shard_cp`, ...)."""
    names: dict[str, str] = {}
    for dim in mesh.root.mesh_dim_names or ():
        names.setdefault(mesh.root.get_group(dim).group_name, dim)
    for purpose, view in mesh.views.items():
        dims = view.mesh_dim_names or ()
        for i, dim in enumerate(dims):
            label = purpose if len(dims) == 1 else f"{purpose}:{dim}"
            names.setdefault(view.get_group(i).group_name, label)
    return names


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


def default_rank(cfg: TrainConfig, dims: ParallelDims) -> tuple[int, float | None]:
    """The first rank of the pipeline stage the planner predicts the highest peak for, and that peak.

    The peak is `DevicePeak.first_step` (`parallel/device_peak.py`): one step from a fresh
    optimizer, whose moments appear at its update, is what the dry run measures.
    """
    from meshforge.parallel.device_peak import predict_device_peak

    try:
        peak = predict_device_peak(cfg, dims.world_size)
    except Exception:  # noqa: BLE001 - without a prediction the dry run still runs rank 0
        return 0, None
    return peak.rank, peak.first_step


def predicted_peak(cfg: TrainConfig, dims: ParallelDims, rank: int) -> float | None:
    """The planner's predicted first-step peak of `rank` (None when it cannot estimate)."""
    from meshforge.parallel.device_peak import predict_device_peak

    try:
        return predict_device_peak(cfg, dims.world_size, rank).first_step
    except Exception:  # noqa: BLE001 - the dry run stands without the comparison
        return None


def synthetic_batch(cfg: TrainConfig, parts: ModelParts, *, pairs: bool) -> Batch:
    """One micro-batch of the configured shape (token ids of the right range; no values matter)."""
    rows = int(cfg.training.local_batch_size)
    seq = int(cfg.train_dataset.seq_length() or cfg.model.seq_length or 0)
    if seq <= 0:
        raise ValueError("a dry run needs a sequence length: set the loader's seq_length or model.seq_length")
    vocab = len(parts.tokenizer)
    ids = torch.randint(0, vocab, (rows, seq))
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.arange(seq).repeat(rows, 1),
    }
    if pairs:
        # One pair per row: chosen = segment 1, rejected = segment 2.
        half = seq // 2
        batch["segment_ids"] = torch.cat(
            [torch.ones(rows, half, dtype=torch.long), torch.full((rows, seq - half), 2)], dim=1
        )
        batch["position_ids"] = torch.cat([torch.arange(half), torch.arange(seq - half)]).repeat(rows, 1)
    return batch


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

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    predicted: float | None
    if rank is None:
        rank, predicted = default_rank(cfg, dims)
    else:
        if not 0 <= rank < world_size:
            raise ValueError(f"--rank {rank}: must be in 0..{world_size - 1}")
        predicted = predicted_peak(cfg, dims, rank)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    lines: list[str] = []
    sink = log or lines.append
    start = time.perf_counter()
    layout = dims.describe()
    with (
        fake_world(rank, world_size),
        tempfile.TemporaryDirectory(prefix="meshforge-dry-run-") as tmp,
        _quiet_torch(),
    ):
        tracker = _ModuleTracker()
        try:
            peak, rows, items, notes = _step(cfg, dims, rank, device_type, Path(tmp), sink, tracker)
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


class _ModuleTracker:
    """The innermost module whose forward or backward is running (for the error message)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def install(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            label = name or type(module).__name__
            self.handles.append(module.register_forward_pre_hook(self._enter(label)))
            self.handles.append(module.register_forward_hook(self._leave(label), always_call=True))

    def _enter(self, label: str) -> Callable[..., None]:
        def hook(*_args: object) -> None:
            self.stack.append(label)

        return hook

    def _leave(self, label: str) -> Callable[..., None]:
        def hook(*_args: object) -> None:
            if self.stack and self.stack[-1] == label:
                self.stack.pop()

        return hook

    def current(self) -> str:
        return f"module {self.stack[-1]}" if self.stack else ""

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _step(
    cfg: TrainConfig,
    dims: ParallelDims,
    rank: int,
    device_type: str,
    output_dir: Path,
    log: Log,
    tracker: _ModuleTracker,
) -> tuple[int, list[CollectiveRow], int, list[str]]:
    """Build rank `rank`'s run on fake tensors and run one optimizer step; (peak, collectives, plan items, notes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.train.batches import plan_batches, to_device
    from meshforge.train.build import build_grad_accumulation, build_optimizer, build_pipeline
    from meshforge.train.build_model import build_model
    from meshforge.train.build_preference import build_preference
    from meshforge.train.replicas import replica_groups
    from meshforge.train.run import OptimParts, Progress, Run, RunData, RunEnv, Watchers
    from meshforge.train.trainer import Trainer
    from meshforge.utils.distributed import DistInfo, all_reduce_sum

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
    preference = build_preference(cfg, env, parts, tokenizer)
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
        optimizer, scheduler, grad_accum, pipeline, checkpointer=_checkpointer(cfg, env, parts)
    )
    # The dry-run step reaches no watcher (no health verdict, sinks or callbacks).
    trainer.run = Run(env, parts, data, optim, cast(Watchers, None), Progress(), preference=preference)
    tracker.install(parts.module)
    recorder = CollectiveRecorder(group_dims(mesh))
    memory = _new_step_peak()
    with fake:
        micro = [
            to_device(synthetic_batch(cfg, parts, pairs=preference is not None), device, pin=False)
            for _ in range(plan.grad_accum_steps)
        ]
        if dims.cp > 1:
            micro = [trainer._shard_for_cp(mb) for mb in micro]
        memory.track_external(parts.module, optimizer)
        with memory, recorder:
            units = sum(
                (preference.count_pairs(mb) if preference else (mb["labels"] != -100).sum()) for mb in micro
            )
            normalizer = all_reduce_sum(
                torch.as_tensor(units, device=device), mesh.view("loss").get_group()
            ).to(torch.float32)
            trainer._aux_sum = torch.zeros((), device=device)
            trainer._mtp_sum = torch.zeros((), device=device)
            loss_sum = trainer.backward_micro_batches(micro, normalizer)
            all_reduce_sum(loss_sum / normalizer, mesh.view("loss").get_group())
            if preference is not None:
                preference._sums = None  # the metric sums hold no values worth reducing
            trainer.clip_grads()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    tracker.remove()
    # Outside the mode: DCP's planner makes small real tensors of its own (shard offsets); the
    # state's fake tensors still dispatch to their mode.
    items = _save_plan_items(optim, parts)
    snapshot = memory.get_tracker_snapshot("peak")
    peak = max((int(stats.get("Total", 0)) for stats in snapshot.values()), default=0)
    if device_type != "cuda":
        notes.append(
            "fake tensors on the CPU device type (this torch has no CUDA runtime): CUDA-only kernels, "
            "streams and events were not exercised"
        )
    return peak, recorder.rows(), items, notes


def _step_peak_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepPeak(MemTracker):
        """torch's `MemTracker` for the step's high-water mark only: its per-module statistics
        refuse a module entered twice from the top (every micro-batch and pipeline stage does),
        and the dry run reads the global peak alone, so the module hooks do nothing."""

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            pass

        def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            pass

    return StepPeak


def _new_step_peak() -> Any:
    return _step_peak_class()()


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


def _checkpointer(cfg: TrainConfig, env: Any, parts: ModelParts) -> Any:
    from meshforge.train.build import build_checkpointer

    return build_checkpointer(cfg.checkpoint, env, parts)


def _save_plan_items(optim: Any, parts: ModelParts) -> int:
    """Items in this rank's DCP save plan of the model and optimizer state (no file written)."""
    plan = optim.checkpointer.local_save_plan(parts.module, optim.optimizer)
    return len(plan.items)
