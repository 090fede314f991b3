"""Activation memory of one micro-batch, measured on fake tensors, for the layout planner.

The planner does not guess a formula per family: it builds the configured model under
``FakeTensorMode`` (tensors with shapes, dtypes and a CPU device but no memory, so a 70B model
costs nothing), applies the run's recompute and swap settings with the same code the trainer
runs (``memory.apply``), and runs one forward (and the loss, chunked or not) at the rank's
shapes under a :class:`~meshforge.memory.ledger.SavedTensorLedger` per decoder layer. Fake
tensors take the CPU's kernel choices, so what attention saves is what a real CPU forward saves
(the ledger of a real one-process forward equals it byte for byte on dense models); flash
attention on CUDA saves the same output and log-sum-exp.

meshforge's MoE layers run here with balanced routing counts (fake tensors have no values;
``models/common/moe.host_ints``). Where a layer still cannot run without data (a transformers
model's own routing code), its feed-forward (``mlp``, else the child holding the routed experts) is replaced by a pass-through for the trace and the experts
are added by formula, for N tokens, k experts per token, expert width I, model width h and
element size d: routed experts ``N*(h + k*(3h + 4I))*d`` (the block's input; per assignment the
gathered input, gate, up, activation, product, output and its weighted copy) plus the router's
``N*E*8`` (fp32 logits and probabilities); any other parameterised child of the feed-forward
(shared experts) is a gated MLP ``N*(2h + 4I_s)*d``. On qwen3_moe this is within 1% of a real
forward's ledger.
That part is dropped when the layer or its feed-forward is recomputed, and moved to host when
swapped. ``recompute_comm`` is not traced (it needs a TP mesh): its saving is not included.

Layers of one kind save the same bytes, so only the first layer of each kind is traced: the
others return their input unchanged (in the structure the traced layer of their kind returned)
and get a copy of its :class:`LayerBytes`. Two layers are of one kind when their classes, the
classes, parameter and buffer shapes and scalar attributes of every submodule (a layer's own
index aside) and the recompute and swap coverage applied to them are the same; a real-size
model has two or three kinds, so its trace costs a few layers, not its depth.

Multi-token-prediction blocks (DeepSeek-V3) run when the run trains them (``mtp=True``): each
block is a layer of its own kind, its logits and loss count with the head's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from meshforge.loss.lm import LMLoss, select_lm_loss
from meshforge.loss.mtp import MTPModel
from meshforge.memory.ledger import SavedTensorLedger

if TYPE_CHECKING:
    from meshforge.memory.apply import ActivationMemory, ActivationSettings


@dataclass
class LayerBytes:
    """Saved-for-backward bytes of one decoder layer for one micro-batch."""

    device: int = 0
    host: int = 0
    formula: bool = False  # part of it comes from the MoE formula


@dataclass
class ActivationEstimate:
    """One micro-batch's activations on one rank, before any tp division or PP scaling.

    Attributes:
        layers: Global layer index -> its bytes.
        outside: Bytes saved outside the layers (embedding, final norm, head and loss).
        notes: How parts were estimated (formula layers), for the plan's memory line.
        loss: The loss formulation traced, for the plan's memory line.
    """

    layers: dict[int, LayerBytes] = field(default_factory=dict)
    outside: int = 0
    notes: list[str] = field(default_factory=list)
    loss: str = "full-logits loss"

    @property
    def device_bytes(self) -> int:
        return self.outside + sum(b.device for b in self.layers.values())

    @property
    def host_bytes(self) -> int:
        return sum(b.host for b in self.layers.values())


class _PassThrough(nn.Module):
    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return x


def _ffn_path(layer: nn.Module) -> str | None:
    """The layer's feed-forward: what ``mlp`` names, else the child holding routed experts."""
    from meshforge.memory.names import match_submodules
    from meshforge.models.common.moe import ExpertsBase

    found = match_submodules(layer, "mlp", key="mlp")
    if found:
        return found[0][0]
    for name, child in layer.named_children():
        if any(isinstance(m, ExpertsBase) for m in child.modules()):
            return name
    return None


def _set_child(layer: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    old = getattr(parent, name)
    setattr(parent, name, module)
    return old


def _moe_formula(ffn: nn.Module, tokens: int, hidden: int, elem: int) -> int:
    """Bytes an MoE feed-forward saves for ``tokens`` tokens (the module docstring's formula)."""
    from meshforge.models.common.moe import ExpertsBase, TopKRouter

    total = 0
    handled: set[int] = set()
    top_k = 1
    for module in ffn.modules():
        if isinstance(module, TopKRouter):
            top_k = module.top_k
            total += tokens * module.num_experts * 8
            handled.update(id(m) for m in module.modules())
    for module in ffn.modules():
        if isinstance(module, ExpertsBase):
            width = int(
                module.down_proj.shape[-1]
                if module.down_proj.shape[-1] != hidden
                else module.down_proj.shape[-2]
            )
            total += tokens * (hidden + top_k * (3 * hidden + 4 * width)) * elem
            handled.update(id(m) for m in module.modules())
    for _, child in ffn.named_children():
        if id(child) in handled:
            continue
        params = sum(p.numel() for p in child.parameters())
        if params:
            width = params // (3 * hidden)
            total += tokens * (2 * hidden + 4 * width) * elem
    return total


def _covered(table: dict[int, list[str]], index: int, path: str) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in table.get(index, []))


def measure_activations(
    build: Callable[[], nn.Module],
    settings: ActivationSettings,
    *,
    micro_batch: int,
    seq: int,
    dtype: torch.dtype,
    chunk_loss_size: int | None,
    mtp: bool = False,
    every_layer: bool = False,
    lm_loss: LMLoss | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
) -> ActivationEstimate:
    """Trace one forward and loss of ``build()`` on fake tensors at ``[micro_batch, seq]``.

    Args:
        build: Builds the model (called under the meta device: no memory is allocated).
        settings: The recompute and swap sections (``recompute_comm`` is ignored here).
        dtype: The compute dtype (the model is cast to it).
        chunk_loss_size: ``kernels.chunk_loss_size`` (None: the full-logits loss).
        mtp: Run the model's multi-token-prediction blocks and their loss (the run trains them).
        every_layer: Trace every layer instead of one per kind (the reference the per-kind
            trace is tested against).
        lm_loss: The run's loss formulation (the fused loss keeps its gradients from forward
            to backward); None: the one ``chunk_loss_size`` selects.
        prepare: Changes the model after the cast to ``dtype`` and before the memory settings,
            as the trainer does between them: a LoRA run's adapters, in their own dtype, on a
            frozen base (a frozen linear saves no input for a weight gradient).

    Raises:
        NotImplementedError: A memory feature the settings ask for is not built.
        ValueError: The settings name layers or modules the model does not have.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshforge.memory.apply import ActivationSettings, apply_activation_memory
    from meshforge.memory.config import RecomputeCommConfig
    from meshforge.memory.names import decoder_layers

    estimate = ActivationEstimate()
    with torch.device("meta"):
        model = build().to(dtype)
        if prepare is not None:
            prepare(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # Fake CPU tensors (meta ones would take the math attention path, not the CPU's).
        model.to_empty(device="cpu")
        layers = decoder_layers(model)
        applied = apply_activation_memory(
            model,
            ActivationSettings(settings.recompute, RecomputeCommConfig(), settings.swap),
            num_layers=len(layers),
            tp_mesh=None,
        )
        embedding = model.get_submodule("model.embed_tokens")
        assert isinstance(embedding, nn.Embedding)
        hidden = int(embedding.weight.shape[-1])
        elem = torch.empty((), dtype=dtype).element_size()
        kinds = _representatives(layers, applied, every_layer=every_layer)
        if mtp and isinstance(model, MTPModel) and model.num_mtp_layers:
            model.set_mtp(True)
        else:
            mtp = False
        if lm_loss is None:
            lm_loss = select_lm_loss(fused=False, chunk_loss_size=chunk_loss_size, vocab_size=None)
        estimate.loss = lm_loss.describe()
        replaced, ran = _trace(model, layers, kinds, estimate, micro_batch, seq, lm_loss, mtp=mtp)
        tokens = micro_batch * seq
        for index, (path, ffn) in replaced.items():
            if index not in ran:
                continue  # an MTP block the run does not train
            part = _moe_formula(ffn, tokens, hidden, elem)
            entry = estimate.layers[index]
            entry.formula = True
            if _covered(applied.recomputed, index, path):
                continue
            if _covered(applied.swapped, index, path):
                entry.host += part
            else:
                entry.device += part
        if mtp:
            depths = cast(MTPModel, model).num_mtp_layers
            estimate.notes.append(f"{depths} MTP block(s) on the last stage")
        if replaced:
            estimate.notes.append(
                f"MoE feed-forward of {len(replaced)} layer(s) by formula (routing needs data)"
            )
    return estimate


# Attributes that number a layer without changing what it computes.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
_SCALARS = (bool, int, float, str, type(None))


def _is_setting(value: object) -> bool:
    """A scalar, or a tuple or list of them (a window size, a layer type)."""
    if isinstance(value, tuple | list):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


def _layer_kind(layer: nn.Module, index: int, applied: ActivationMemory) -> tuple[object, ...]:
    """What decides a layer's saved bytes: structure, shapes, settings and memory coverage."""
    parts: list[object] = [type(layer)]
    for path, module in layer.named_modules():
        tensors = [
            (name, tuple(t.shape), t.dtype)
            for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        ]
        attributes = sorted(
            (key, value)
            for key, value in vars(module).items()
            if not key.startswith("_") and key not in _INDEX_ATTRIBUTES and _is_setting(value)
        )
        parts.append((path, type(module), tuple(tensors), tuple(attributes)))
    for table in (applied.recomputed, applied.swapped):
        parts.append(tuple(sorted(table.get(index, []))))
    return tuple(parts)


def _representatives(
    layers: list[tuple[int, nn.Module]], applied: ActivationMemory, *, every_layer: bool
) -> dict[int, int]:
    """``layer index -> index of the layer traced for it`` (the first layer of its kind)."""
    if every_layer:
        return {index: index for index, _ in layers}
    first: dict[tuple[object, ...], int] = {}
    return {index: first.setdefault(_layer_kind(layer, index, applied), index) for index, layer in layers}


def _trace(
    model: nn.Module,
    layers: list[tuple[int, nn.Module]],
    kinds: dict[int, int],
    estimate: ActivationEstimate,
    micro_batch: int,
    seq: int,
    lm_loss: LMLoss,
    *,
    mtp: bool,
) -> tuple[dict[int, tuple[str, nn.Module]], set[int]]:
    """Run the traced forward; ``layer -> (path, module)`` of feed-forwards replaced for it,
    and the layers the forward called.

    A layer that fails (data-dependent routing) has its feed-forward swapped for a
    pass-through, with every layer whose feed-forward is of the same class, and the forward
    runs again. Layers that are not their kind's representative pass their input through.
    """
    from meshforge.loss.cross_entropy import mtp_cross_entropy_sum

    replaced: dict[int, tuple[str, nn.Module]] = {}
    by_index = dict(layers)
    for _attempt in range(len(layers) + 1):
        estimate.layers = {index: LayerBytes() for index, _ in layers}
        open_: list[tuple[int, _Recording]] = []
        calls = _Calls(estimate, kinds)
        classes = [_measure_calls(layer, open_, calls, index) for index, layer in layers]
        outer = SavedTensorLedger()
        outer.exclude(model.parameters())
        try:
            with outer.recording():
                ids = torch.zeros((micro_batch, seq), dtype=torch.long)
                head_weight = None
                if lm_loss.needs_hidden:
                    hidden = model(ids, return_hidden=True)
                    head = model.get_submodule("lm_head")
                    assert isinstance(head, nn.Linear)
                    head_weight = head.weight
                    lm_loss(hidden, ids, head.weight)
                else:
                    out = model(ids)
                    lm_loss(out if isinstance(out, torch.Tensor) else out.logits, ids)
                if mtp:
                    outputs = cast(MTPModel, model).mtp_outputs()
                    mtp_cross_entropy_sum(outputs, ids, head_weight=head_weight, loss_fn=lm_loss)
            estimate.outside = outer.device_bytes
            calls.copy_to_skipped()
            return replaced, calls.ran
        except (RuntimeError, NotImplementedError) as err:
            if "not supported yet" in str(err) or not open_:
                raise
            failed = open_[-1][0]
            path = _ffn_path(by_index[failed])
            if path is None or failed in replaced:
                raise
            kind = type(by_index[failed].get_submodule(path))
            for index, layer in layers:
                ffn_path = _ffn_path(layer)
                if ffn_path is not None and type(layer.get_submodule(ffn_path)) is kind:
                    replaced[index] = (ffn_path, _set_child(layer, ffn_path, _PassThrough()))
        finally:
            while open_:
                open_.pop()[1].close()
            for (_, layer), cls in zip(layers, classes, strict=True):
                layer.__class__ = cls
    raise RuntimeError("the traced forward failed in every layer")


class _Calls:
    """Which layers ran for real in one traced forward, and what each kind's representative returned."""

    def __init__(self, estimate: ActivationEstimate, kinds: dict[int, int]) -> None:
        self.estimate = estimate
        self.kinds = kinds
        self.outputs: dict[int, object] = {}
        self.skipped: set[int] = set()
        self.ran: set[int] = set()

    def passed_through(
        self, index: int, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object | None:
        """The layer's input in its representative's output structure, or None to run it."""
        rep = self.kinds[index]
        if rep == index or rep not in self.outputs:
            return None
        x = args[0] if args else kwargs.get("hidden_states")
        template = self.outputs[rep]
        if not isinstance(x, torch.Tensor):
            return None
        if isinstance(template, torch.Tensor) and template.shape == x.shape:
            out: object = x
        elif type(template) is tuple and template and isinstance(template[0], torch.Tensor):
            out = (x, *template[1:])
        else:
            return None
        self.skipped.add(index)
        return out

    def copy_to_skipped(self) -> None:
        for index in self.skipped:
            rep = self.estimate.layers[self.kinds[index]]
            self.estimate.layers[index] = LayerBytes(rep.device, rep.host)


def _measure_calls(
    layer: nn.Module, open_: list[tuple[int, _Recording]], calls: _Calls, index: int
) -> type[nn.Module]:
    """Record each call of ``layer`` in its own ledger; returns the class to restore.

    The ledger opens around the whole call, outside a recomputed region (recompute wraps
    the layer's call, hooks included), so the checkpoint's own hooks stay innermost and the
    region's inputs are counted to this layer. A layer whose kind was traced already passes
    its input through instead.
    """
    cls = type(layer)

    def __call__(self: nn.Module, *args: object, **kwargs: object) -> object:
        calls.ran.add(index)
        skipped = calls.passed_through(index, args, kwargs)
        if skipped is not None:
            return skipped
        open_.append((index, _Recording(self, calls.estimate.layers[index])))
        out = cls.__call__(self, *args, **kwargs)
        open_.pop()[1].close()
        calls.outputs.setdefault(index, out)
        return out

    measured = type(f"Measured{cls.__name__}", (cls,), {"__call__": __call__, "__module__": cls.__module__})
    layer.__class__ = measured
    return cls


class _Recording:
    """One layer forward's ledger, open from the layer's pre-hook to its post-hook.

    ``close`` adds its totals to the layer's entry.
    """

    def __init__(self, layer: nn.Module, into: LayerBytes) -> None:
        self.ledger = SavedTensorLedger()
        self.ledger.exclude(layer.parameters())
        self.into = into
        self.ctx = self.ledger.recording()
        self.ctx.__enter__()

    def close(self) -> None:
        self.ctx.__exit__(None, None, None)
        self.into.device += self.ledger.device_bytes
        self.into.host += self.ledger.host_bytes


__all__ = ["ActivationEstimate", "LayerBytes", "measure_activations"]
