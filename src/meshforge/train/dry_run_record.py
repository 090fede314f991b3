"""What a dry run (`train/dry_run.py`) records of its step: collectives, memory, the module.

`CollectiveRecorder` is a dispatch mode over the step: every c10d or functional collective by
mesh dimension (`group_dims` names the process groups), kind, count and bytes, and matmuls of
mixed dtypes refused as the device kernels refuse them (fake tensors' shape functions do not).
`new_step_peak` is torch's `MemTracker` for the step's high-water mark alone (feeding an
`AllocatorReplay` for the reserved bytes); `ModuleTracker`
keeps the module a failing step was in.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from meshforge.parallel.dims import ParallelMesh
    from meshforge.train.allocator_replay import AllocatorReplay


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


class CollectiveRecorder(TorchDispatchMode):
    """Counts every collective op that passes, keyed by (mesh dimension, kind), with its bytes,
    and refuses matmuls of mixed dtypes as the device kernels do.

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
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if namespace == "aten" and name in _SAME_DTYPE_OPS:
            _check_same_dtype(name, args)
        result = func(*args, **(kwargs or {}))
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


# Matmuls whose device kernels require one dtype for every operand; their fake-tensor shape
# functions do not check it, so a float32 activation meeting bf16 weights would pass unseen.
_SAME_DTYPE_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm"}


def _check_same_dtype(name: str, args: Sequence[object]) -> None:
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(set(dtypes)) > 1:
        found = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise RuntimeError(
            f"aten.{name}: expected one dtype for every operand, got {found} (the device kernel refuses "
            "mixed dtypes: a module returned another dtype than the next one computes in)"
        )


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


def group_dims(mesh: ParallelMesh, model: torch.nn.Module | None = None) -> dict[str, str]:
    """Process-group name -> the mesh dimension it spans (`tp`, `fsdp:dp_shard_cp`, ...); with
    `model`, also hybrid context parallelism's sub-groups (`cp:ring`, `cp:ulysses`)."""
    labels: dict[str, list[str]] = {}
    if model is not None:
        from meshforge.parallel.context.plan import ContextParallel

        for module in model.modules():
            plan = getattr(module, "cp", None)
            if isinstance(plan, ContextParallel) and plan.method == "hybrid":
                for label, group in (("cp:ring", plan.ring_group), ("cp:ulysses", plan.ulysses_group)):
                    if group is not None:
                        labels.setdefault(group.group_name, [label])
    for purpose, view in mesh.views.items():
        dims = view.mesh_dim_names or ()
        for i, dim in enumerate(dims):
            label = purpose if len(dims) == 1 else f"{purpose}:{dim}"
            labels.setdefault(view.get_group(i).group_name, []).append(label)
    for dim in mesh.root.mesh_dim_names or ():
        labels.setdefault(mesh.root.get_group(dim).group_name, [dim])
    # One group serves several purposes (FSDP's shards are also the loss's ranks): name them all.
    return {name: "/".join(dict.fromkeys(found)) for name, found in labels.items()}


class ModuleTracker:
    """The innermost module whose forward or backward is running (for the error message)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def install(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            label = name or type(module).__name__
            self.handles.append(module.register_forward_pre_hook(self._enter(label)))
            # Not `always_call`: a failing module stays on the stack, to be named.
            self.handles.append(module.register_forward_hook(self._leave(label)))

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


class _NoModules:
    """The module tracker `MemTracker` consults, tracking nothing: torch's `ModTracker` hooks
    every module's inputs for backward, which a pipeline stage's `autograd.grad` on its leaf
    inputs refuses, and re-entering a module (every micro-batch does) trips its statistics.
    The dry run reads the step's global high-water mark only."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: object) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: object) -> str | None:
        return None

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: object) -> None:
        pass


def new_step_peak(replay: AllocatorReplay | None = None) -> Any:
    """torch's `MemTracker` (allocations and frees of every storage, storage resizes included)
    without its per-module statistics; each allocation, resize and free also goes to `replay`
    (the caching allocator's placement, for the reserved bytes) when given."""
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

    class _Replaying(MemTracker):
        def _update_snap(
            self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None
        ) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if replay is None:
                return
            if u_type in (_UpdateType.ADD, _UpdateType.SIZE):
                replay.allocate(winfo, int(winfo.mem_consumed))
            elif u_type == _UpdateType.DEL:
                replay.free(winfo)

    memory = _Replaying()
    memory._mod_tracker = _NoModules()  # type: ignore[assignment]
    return memory


def peak_total(snapshot: dict[Any, dict[Any, int]]) -> int:
    """The largest device's `Total` in a `MemTracker` snapshot."""
    return max((int(stats.get("Total", 0)) for stats in snapshot.values()), default=0)
