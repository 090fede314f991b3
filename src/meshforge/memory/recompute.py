"""Activation recomputation: full layers, selected submodules, kept operators.

Each call of a selected module runs inside a non-reentrant ``torch.utils.checkpoint``: autograd
keeps only the call's inputs, and the call runs again in backward when its first saved tensor
is needed. The region is the module's whole call, hooks included (TP's input preparation, a
token mixer's parameter swap, FSDP's unshard, which stands aside in backward), so the
recomputation sees what the first run saw; the module's class is swapped for a subclass that
does this (as FSDP2 does), and nothing is added to the module tree: parameter names, module
patterns (TP, FSDP units) and checkpoints stay as they were.

The recomputation rebuilds saved tensors and nothing else: the records a forward leaves on its
modules (an MoE block's routing statistics and counts) are put back as the forward left them.
Left rebound, a record that carries autograd history (the router probabilities' sum) would keep
the recomputed region's whole graph, every tensor it saved, alive until the next forward: with
every layer recomputed, backward would end holding all of them, as if nothing were recomputed.

``recompute.exclude_op`` keeps the outputs of the named operators inside every recomputed
region (``create_selective_checkpoint_contexts`` with a policy, as torchtitan's selective-op
AC does); the rest of the region is recomputed. ``matmul/2`` keeps one call in two (torchtitan's
default op policy keeps every second matmul of a layer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TypeAlias

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from meshforge.memory.config import RecomputeConfig
from meshforge.memory.ledger import SavedTensorLedger, active_ledger
from meshforge.memory.names import decoder_layers, layer_indices, match_submodules, no_match_error
from meshforge.memory.ops import OP_ALIASES, split_every

# What `recompute.exclude_op` names: one overload (`aten.mm.default`) or all of them (`aten.mm`).
AtenOp: TypeAlias = torch._ops.OpOverload | torch._ops.OpOverloadPacket


class _Depth(threading.local):
    """How many recomputed regions this thread runs inside (a recomputation runs on the thread
    autograd runs backward on, an accelerator's own thread)."""

    value = 0


_DEPTH = _Depth()
_AGAIN = _Depth()  # how many of those regions are recomputations (in backward)


def in_recomputed_region() -> bool:
    """Whether a recomputed region is running now (its saved tensors are the checkpoint's)."""
    return _DEPTH.value > 0


def recomputing() -> bool:
    """Whether a region is running again in backward (hooks that count forwards skip it)."""
    return _AGAIN.value > 0


@contextmanager
def _region() -> Iterator[None]:
    _DEPTH.value += 1
    try:
        yield
    finally:
        _DEPTH.value -= 1


def resolve_ops(names: Sequence[str] | None) -> list[AtenOp]:
    """The aten operators (``OpOverload`` or ``OpOverloadPacket``) that ``recompute.exclude_op`` names.

    Accepted: ``aten.mm.default`` (one overload), ``aten.mm`` or ``mm`` (every overload), and
    the reference-style words of ``OP_ALIASES`` (``matmul``, ``flash_attention``, ...).

    Raises:
        ValueError: ``recompute.exclude_op[i]`` names no operator.
    """
    return [op for op, _every in resolve_kept(names)]


def resolve_kept(names: Sequence[str] | None) -> list[tuple[AtenOp, int]]:
    """``(operator, every)`` of each ``recompute.exclude_op`` entry: ``matmul/2`` keeps the output
    of every second matmul call of a region (the first, third, ...), ``matmul`` of every call.

    Raises:
        ValueError: ``recompute.exclude_op[i]`` names no operator or a bad ``/N``.
    """
    kept: list[tuple[AtenOp, int]] = []
    for i, raw in enumerate(names or ()):
        try:
            name, every = split_every(raw)
        except ValueError as error:
            raise ValueError(f"recompute.exclude_op[{i}]: {error}") from None
        targets = OP_ALIASES.get(name.lower(), (name,))
        for target in targets:
            op = _aten(target)
            if op is None:
                if name.lower() in OP_ALIASES:
                    continue  # an alias lists kernels some builds lack (cuDNN attention on CPU)
                raise ValueError(
                    f"recompute.exclude_op[{i}]: {raw!r} is not an aten operator or a known alias; "
                    f"write 'aten.mm', 'mm', 'aten.mm.default' or one of {', '.join(sorted(OP_ALIASES))} "
                    "(optionally followed by /N: keep one call's output in every N)"
                )
            kept.append((op, every))
    return kept


def _aten(name: str) -> AtenOp | None:
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    if not parts or len(parts) > 2 or not all(p.isidentifier() for p in parts):
        return None
    try:
        packet = getattr(torch.ops.aten, parts[0])
    except (AttributeError, RuntimeError):
        return None
    if len(parts) == 1:
        return packet
    try:
        return getattr(packet, parts[1])
    except (AttributeError, RuntimeError):
        return None


class _KeptIndex:
    """`recompute.exclude_op`'s entries by operator (one overload, or every overload of a packet),
    looked up once per dispatched operator."""

    def __init__(self, kept: Sequence[tuple[AtenOp, int]]) -> None:
        self.every = [every for _op, every in kept]
        self.overloads: dict[object, list[int]] = {}
        self.packets: dict[object, list[int]] = {}
        for i, (op, _every) in enumerate(kept):
            table = self.overloads if isinstance(op, torch._ops.OpOverload) else self.packets
            table.setdefault(op, []).append(i)

    def entries(self, func: torch._ops.OpOverload) -> list[int]:
        return self.overloads.get(func, []) + self.packets.get(func.overloadpacket, [])


class _Policy:
    """The selective-checkpoint policy of one region call: an operator of ``kept`` is saved on
    one call in every ``every`` (counted per entry, separately in the forward and in the
    recomputation, which run the same operators in the same order and so decide alike)."""

    def __init__(self, kept: _KeptIndex) -> None:
        self.kept = kept
        self.counts = {False: [0] * len(kept.every), True: [0] * len(kept.every)}
        self.last: tuple[object, CheckpointPolicy] | None = None

    def __call__(
        self, ctx: object, func: torch._ops.OpOverload, *_args: object, **_kwargs: object
    ) -> CheckpointPolicy:
        counts = self.counts[bool(getattr(ctx, "is_recompute", False))]
        save = False
        for i in self.kept.entries(func):
            counts[i] += 1
            save = save or (counts[i] - 1) % self.kept.every[i] == 0
        decision = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        self.last = (func, decision)
        return decision

    def decided_to_save(self, func: torch._ops.OpOverload) -> bool:
        """Whether the forward's latest decision, for ``func``, was to keep its output."""
        return self.last is not None and self.last[0] is func and self.last[1] == CheckpointPolicy.MUST_SAVE


class _KeptOutputs(TorchDispatchMode):
    """Report to the ledger the outputs a selective policy keeps (they stay held for backward)."""

    def __init__(self, ledger: SavedTensorLedger, policy: _Policy) -> None:
        super().__init__()
        self.ledger = ledger
        self.policy = policy

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        self.policy.last = None
        out = func(*args, **(kwargs or {}))
        if self.policy.decided_to_save(func):
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self.ledger.add(tensor)
        return out


def _context_fn(
    kept: Sequence[tuple[AtenOp, int]],
) -> Callable[[], tuple[AbstractContextManager[object], AbstractContextManager[object]]]:
    index = _KeptIndex(kept)

    def context() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
        policy = _Policy(index)
        forward, recompute = create_selective_checkpoint_contexts(policy)
        ledger = active_ledger()
        if ledger is None or in_recomputed_region():
            return forward, recompute
        stack = ExitStack()

        @contextmanager
        def counted() -> Iterator[None]:
            with stack:
                stack.enter_context(forward)
                stack.enter_context(_KeptOutputs(ledger, policy))
                yield

        return counted(), recompute

    return context


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_OPS = "_meshforge_recompute_ops"


def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with a ``__call__`` that runs the whole module call as one checkpointed region.

    The region is the call, not only ``forward``: the module's own hooks (TP's input
    preparation, a token mixer's parameter swap, FSDP's unshard, which stands aside in
    backward) run again with the recomputation, so it sees exactly what the first run saw.
    """
    made = _CLASSES.get(cls)
    if made is None:
        base_call = cls.__call__

        def __call__(self: nn.Module, *args: object, **kwargs: object) -> object:
            return _checkpointed_call(self, base_call, args, kwargs)

        made = type(f"Recomputed{cls.__name__}", (cls,), {"__call__": __call__, "__module__": cls.__module__})
        _CLASSES[cls] = made
    return made


def _checkpointed_call(
    module: nn.Module, call: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    if not torch.is_grad_enabled() or in_recomputed_region():
        # Evaluation saves nothing; inside another region (or its recomputation) the outer
        # checkpoint already recomputes this module.
        return call(module, *args, **kwargs)
    if kwargs.get("past_key_values") is not None:
        # A cache updated by the forward would be updated again by the recomputation.
        kwargs = {**kwargs, "past_key_values": None}
    ledger = active_ledger()
    if ledger is not None:
        # The checkpoint holds the region's inputs (the rest is recomputed).
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                ledger.add(leaf)

    forward_done = False

    def run(*inputs: object) -> object:
        nonlocal forward_done
        if forward_done:
            return _recomputation(module, lambda: call(module, *inputs, **kwargs))
        with _region():
            out = call(module, *inputs, **kwargs)
        forward_done = True
        return out

    # Keyword arguments go through the closure: none can clash with checkpoint's own. The
    # recomputation runs to the end (no early stop): hooks that undo what a pre-hook did (a
    # parameter swapped for its local shard, then back) must run in it as they did in forward.
    return checkpoint(run, *args, use_reentrant=False, context_fn=module.__dict__[_OPS], early_stop=False)


def _recomputation(module: nn.Module, rerun: Callable[[], object]) -> object:
    """Run ``rerun`` (the region again, in backward), then put back the public attributes of
    ``module``'s modules that it rebound or added: those are the forward's records (see the
    module docstring); private ones belong to torch's and the hooks' own bookkeeping."""
    before = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in module.modules()]
    _AGAIN.value += 1
    try:
        with _region():
            return rerun()
    finally:
        _AGAIN.value -= 1
        for m, kept in before:
            now = vars(m)
            for key in [k for k in now if not k.startswith("_") and k not in kept]:
                del now[key]
            now.update(kept)


def checkpoint_module(module: nn.Module, *, ops: Sequence[AtenOp | tuple[AtenOp, int]] = ()) -> None:
    """Make every call of ``module`` a non-reentrant checkpointed region, in place (idempotent).

    The module's class becomes a subclass of its class (as FSDP2's ``fully_shard`` does): the
    module tree, parameter names and ``isinstance`` checks are unchanged.

    Args:
        ops: operators whose outputs are kept inside the region (a selective policy), each
            alone (every call kept) or as ``(operator, every)``; empty: everything but the
            inputs is recomputed.
    """
    if _OPS in module.__dict__:
        return
    kept = [op if isinstance(op, tuple) else (op, 1) for op in ops]
    module.__dict__[_OPS] = _context_fn(kept) if kept else noop_context_fn
    module.__class__ = _recomputed_class(type(module))


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop matches inside another match (the outer region recomputes them already)."""
    paths = [p for p, _ in found]
    return [(p, m) for p, m in found if not any(p != q and p.startswith(q + ".") for q in paths)]


def recompute_plan(
    model: nn.Module, cfg: RecomputeConfig, *, num_layers: int
) -> tuple[list[tuple[str, nn.Module]], dict[int, list[str]]]:
    """The modules ``cfg`` recomputes on this rank: ``(path, module)`` and ``layer -> paths``.

    ``full_recompute_layer`` and ``modules`` select whole regions, ``select_module`` submodules
    of the layers it lists; the two may not meet in one layer.

    Raises:
        ValueError: a layer beyond ``num_layers``, a module key that matches nothing in a listed
            layer (held by this rank), a module pattern that matches nothing, a layer both fully
            recomputed and selected. Each message names the key.
    """
    from meshforge.utils.patterns import match_modules

    layers = dict(decoder_layers(model))
    stage = len(layers) < num_layers  # a pipeline stage holds some of the layers
    targets: dict[str, nn.Module] = {}
    applied: dict[int, list[str]] = {}
    full = layer_indices(cfg.full_recompute_layer)
    _check_range(full, num_layers, "recompute.full_recompute_layer")
    for index in sorted(full & layers.keys()):
        targets[f"model.layers.{index}"] = layers[index]
        applied[index] = [""]
    whole_from_patterns: dict[int, str] = {}
    if cfg.modules:
        for path, module in match_modules(
            model, list(cfg.modules), key_path="recompute.modules", allow_unmatched=stage
        ):
            targets.setdefault(path, module)
            at, sub = _layer_of(path)
            if at is not None:
                applied.setdefault(at, [])
                if sub not in applied[at]:
                    applied[at].append(sub)
                whole_from_patterns.setdefault(at, path)
    for key, specs in (cfg.select_module or {}).items():
        path_key = f"recompute.select_module.{key}"
        wanted = layer_indices(specs)
        _check_range(wanted, num_layers, path_key)
        clash = sorted(wanted & full) or sorted(
            i for i in wanted if whole_from_patterns.get(i) == f"model.layers.{i}"
        )
        if clash:
            raise ValueError(
                f"{path_key}: layer {clash[0]} is also recomputed whole (recompute.full_recompute_layer "
                "or recompute.modules); list each layer under one of them"
            )
        for index in sorted(wanted & layers.keys()):
            found = match_submodules(layers[index], key, key=path_key)
            if not found:
                raise no_match_error(path_key, key, layers[index], [index])
            for sub, module in _outermost(found):
                targets.setdefault(f"model.layers.{index}.{sub}", module)
                applied.setdefault(index, [])
                if sub not in applied[index]:
                    applied[index].append(sub)
    return _outermost(sorted(targets.items())), applied


def _check_range(indices: set[int], num_layers: int, key: str) -> None:
    beyond = sorted(i for i in indices if i >= num_layers)
    if beyond:
        raise ValueError(f"{key}: layer {beyond[0]} is out of range [0, {num_layers - 1}]")


def _layer_of(path: str) -> tuple[int | None, str]:
    parts = path.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]), ".".join(parts[3:])
    return None, path


def apply_recompute(model: nn.Module, cfg: RecomputeConfig, *, num_layers: int) -> dict[int, list[str]]:
    """Wrap the forwards ``cfg`` selects in non-reentrant checkpoints; ``layer -> paths`` applied.

    Raises:
        ValueError: see ``recompute_plan``; an unknown ``recompute.exclude_op`` entry.
    """
    ops = resolve_kept(cfg.exclude_op)
    targets, applied = recompute_plan(model, cfg, num_layers=num_layers)
    for _path, module in targets:
        checkpoint_module(module, ops=ops)
    return applied


__all__ = [
    "apply_recompute",
    "checkpoint_module",
    "in_recomputed_region",
    "recompute_plan",
    "recomputing",
    "resolve_kept",
    "resolve_ops",
]
