"""Every built-in family's decoder layers compile to one graph each (no graph breaks).

Regional compilation (``kernels.compile``) compiles each decoder layer; a graph break inside a
layer splits it into several graphs with eager Python between them, which costs the fusions the
compile is for. For every family of the registry (a new family is covered by its spec alone)
the tiniest model runs one eager forward that records what the model passes to each layer
(hidden states, RoPE tables, the packed-document mask, the token mask of the MoE layers), and
``torch._dynamo.explain`` traces one layer of each distinct kind (dense, MoE, linear attention,
sliding window, mamba, ...) with exactly those inputs.

The same holds with the ``kernels.pre_tokens`` window on every family with attention layers,
with the MoE switches (``moe_grouped_gemm``, ``fix_router``), inside full recompute (the
checkpoint wraps the compiled call), under ulysses and kvallgather context parallelism on a
one-rank CP mesh (``tests/distributed/test_cp_compile.py`` runs two ranks), and across rows of
varying length (at most two graphs per layer kind). The ring methods
(colossal, hybrid) run their block plan eagerly: their only breaks are around that call.

The per-expert loop of the MoE layers needs its group sizes as Python ints: under compile they
are unbacked symbols, which needs ``torch._dynamo.config.capture_scalar_outputs`` (set here by
a fixture, and wherever layers are compiled). The grouped-GEMM path needs no host value, but
torch 2.13 traces ``grouped_mm`` only in bfloat16, so that case runs the layer in bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from meshforge.memory.config import RecomputeConfig
from meshforge.memory.recompute import apply_recompute
from meshforge.models.common.kernels import KernelOptions
from meshforge.models.common.moe import ExpertsBase
from meshforge.models.registry import SPECS
from meshforge.models.spec import FamilySpec

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}
FAMILIES = [spec.name for spec in SPECS]
SEQ = 16
# Two packed rows: documents of 5, 7 and 4 tokens; 10 and 4 tokens then 2 of padding.
SEGMENTS = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 10 + [2] * 4 + [0] * 2])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    with dynamo.config.patch(capture_scalar_outputs=True):
        yield
    dynamo.reset()


def _build(spec: FamilySpec, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return spec.build({"flavor": "tiny"}, device="cpu").to(dtype)


def _is_moe(model: nn.Module) -> bool:
    return any(isinstance(m, ExpertsBase) for m in model.modules())


MOE_FAMILIES = [
    name for name in FAMILIES if _is_moe(SPEC_BY_NAME[name].build({"flavor": "tiny"}, device="meta"))
]


def packed_positions(segments: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 per document, as the packing loaders write ``position_ids``."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    index = torch.arange(segments.shape[1]).expand_as(segments)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def _kind(layer: nn.Module) -> tuple[Any, ...]:
    """What tells layer kinds apart: the module types and their plain settings (window, ...)."""
    parts = []
    for name, module in layer.named_modules():
        plain = tuple(
            sorted(
                (key, value)
                for key, value in vars(module).items()
                if not key.startswith("_") and "idx" not in key and isinstance(value, (bool, int, float, str))
            )
        )
        parts.append((name, type(module).__name__, plain))
    return tuple(parts)


def packed_batch(model: nn.Module) -> dict[str, torch.Tensor]:
    """Two packed rows as the SFT loaders give them: ids, labels, restarting positions, documents."""
    ids = torch.randint(0, model.config.vocab_size, SEGMENTS.shape)
    labels = ids.masked_fill(SEGMENTS == 0, -100)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": packed_positions(SEGMENTS),
        "segment_ids": SEGMENTS,
    }


def layer_calls(
    model: nn.Module, batch: dict[str, torch.Tensor] | None = None, *, packed: bool = True
) -> list[tuple[nn.Module, tuple, dict]]:
    """One ``(layer, args, kwargs)`` per distinct layer kind, as the model's forward calls them.

    ``batch`` (default: :func:`packed_batch`, without its documents unless ``packed``) is what
    the trainer would hand the model.
    """
    calls: dict[tuple[Any, ...], tuple[nn.Module, tuple, dict]] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.setdefault(_kind(module), (module, args, kwargs))

    if batch is None:
        batch = packed_batch(model)
        if not packed:
            batch = {"input_ids": batch["input_ids"]}
    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
    finally:
        for hook in hooks:
            hook.remove()
    assert calls, "no decoder layer ran"
    return list(calls.values())


def _detached(value: Any, *, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(requires_grad and value.dim() == 3)
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v, requires_grad=requires_grad) for v in value)
    return value


def assert_one_graph(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """``explain`` of one layer call: a single graph, or the reasons it broke."""
    dynamo.reset()
    explained = dynamo.explain(layer)(*_detached(args, requires_grad=False), **kwargs)
    reasons = [
        f"{r.reason.splitlines()[0]} at {r.user_stack[-1] if r.user_stack else '?'}"
        for r in explained.break_reasons
    ]
    assert explained.graph_break_count == 0, (
        f"{type(layer).__name__}: {explained.graph_break_count} breaks:\n" + "\n".join(reasons)
    )
    assert explained.graph_count == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_every_layer_kind_is_one_graph(family: str, packed: bool):
    model = _build(SPEC_BY_NAME[family])
    for layer, args, kwargs in layer_calls(model, packed=packed):
        assert_one_graph(layer, args, kwargs)


def _has_attention(name: str) -> bool:
    from meshforge.models.common.attention import AttentionBase

    model = SPEC_BY_NAME[name].build({"flavor": "tiny"}, device="meta")
    return any(isinstance(m, AttentionBase) for m in model.modules())


@pytest.mark.parametrize("family", [name for name in FAMILIES if _has_attention(name)])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_pre_tokens_window_keeps_one_graph(family: str, packed: bool):
    # The band mask is built inside each attention call (from the shapes), on top of the
    # packed-document mask or of none.
    model = _build(SPEC_BY_NAME[family])
    model.configure_kernels(KernelOptions(pre_tokens=3))
    for layer, args, kwargs in layer_calls(model, packed=packed):
        assert_one_graph(layer, args, kwargs)


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("switch", ["grouped_mm", "fix_router"])
def test_moe_switches_keep_one_graph(family: str, switch: str):
    # grouped_mm is traced in bfloat16 only (torch 2.13's shape function of the op).
    model = _build(SPEC_BY_NAME[family], torch.bfloat16 if switch == "grouped_mm" else torch.float32)
    model.configure_kernels(KernelOptions(**{switch: True}))
    if switch == "grouped_mm":
        assert all(m.use_grouped_mm for m in model.modules() if isinstance(m, ExpertsBase))
    for layer, args, kwargs in layer_calls(model):
        assert_one_graph(layer, args, kwargs)


class _CountingBackend:
    """A compile backend that counts the graphs it is given and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_recomputed_layer_still_compiles_whole(family: str):
    """Full recompute wraps each layer's call in a checkpoint; the compiled ``_call_impl`` inside
    it (``nn.Module.compile``, as ``kernels.compile`` does after recompute) stays one graph, in
    forward and in the recomputation of backward."""
    model = _build(SPEC_BY_NAME[family])
    num_layers = len(model.model.layers)
    apply_recompute(
        model,
        RecomputeConfig(mode="full", full_recompute_layer=[f"0-{num_layers - 1}"]),
        num_layers=num_layers,
    )
    for layer, args, kwargs in layer_calls(model):
        assert type(layer).__name__.startswith("Recomputed")
        dynamo.reset()
        dynamo.utils.counters.clear()
        backend = _CountingBackend()
        layer.compile(backend=backend)
        inputs = _detached(args, requires_grad=True)
        layer(*inputs, **kwargs).square().sum().backward()
        assert inputs[0].grad is not None
        breaks = dict(dynamo.utils.counters["graph_break"])
        assert not breaks, breaks
        assert backend.graphs == 1, f"{backend.graphs} graphs for one recomputed {type(layer).__name__}"
        layer._compiled_call_impl = None


def _cp_families(method: str) -> list[str]:
    return [
        s.name
        for s in SPECS
        if s.cp_modules is not None
        and (s.cp_methods is None or method in s.cp_methods)
        and s.cp_methods != ()
    ]


@pytest.fixture
def cp_mesh() -> Iterator[Any]:
    """A one-rank CP mesh: the CP code path of every layer (plan, CPMask, collectives), in process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    existed = dist.is_initialized()
    if not existed:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    if not existed:
        dist.destroy_process_group()


def _cp_layer_calls(family: str, method: str, mesh: Any) -> list[tuple[nn.Module, tuple, dict]]:
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    model = _build(SPEC_BY_NAME[family])
    apply_cp(model, mesh, method=method)
    return layer_calls(model, shard_batch_for_cp(packed_batch(model), mesh, method=method))


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
@pytest.mark.parametrize(
    ("family", "method"), [(f, m) for m in ("ulysses", "kvallgather") for f in _cp_families(m)]
)
def test_context_parallel_layers_are_one_graph(family: str, method: str, cp_mesh: Any):
    """Under ulysses and kvallgather CP the layer's attention (exchanges included) stays in its graph."""
    for layer, args, kwargs in _cp_layer_calls(family, method, cp_mesh):
        assert_one_graph(layer, args, kwargs)


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
@pytest.mark.parametrize("method", ["ulysses", "kvallgather"])
def test_context_parallel_window_is_one_graph(method: str, cp_mesh: Any):
    """``pre_tokens`` under CP: the window the plan gets is a Python int, its mask built in the graph."""
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    model = _build(SPEC_BY_NAME["qwen3"])
    model.configure_kernels(KernelOptions(pre_tokens=3))
    apply_cp(model, cp_mesh, method=method)
    for layer, args, kwargs in layer_calls(
        model, shard_batch_for_cp(packed_batch(model), cp_mesh, method=method)
    ):
        assert_one_graph(layer, args, kwargs)


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_ring_context_parallel_breaks_only_at_the_ring(family: str, cp_mesh: Any):
    """The ring (colossal) runs its block plan eagerly: the only breaks are that call's, one per
    layer call (the graphs before and after it), nothing else in the layer."""
    for layer, args, kwargs in _cp_layer_calls(family, "colossal", cp_mesh):
        dynamo.reset()
        explained = dynamo.explain(layer)(*args, **kwargs)
        reasons = {r.reason.splitlines()[0] for r in explained.break_reasons}
        assert reasons == {"Skip inlining `torch.compiler.disable()`d function"}, reasons
        assert all("self._ring(" in (r.user_stack[-1].line or "") for r in explained.break_reasons), [
            r.user_stack[-1] for r in explained.break_reasons
        ]


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
# Packed: an MoE and a sliding-window family; plain rows: every SDPA call site without a mask
# (common attention, MLA, minimax_m2's and qwen3_next's own). mamba3, step3p5 and the other
# pairs pass too, at 5-15 s each.
@pytest.mark.parametrize(
    ("family", "packed"),
    [("qwen3_moe", True), ("gpt_oss", True), ("qwen3", False), ("deepseek_v3", False)]
    + [("minimax_m2", False), ("qwen3_next", False)],
)
def test_varying_lengths_compile_each_layer_kind_at_most_twice(family: str, packed: bool):
    """Rows of four lengths through one compiled layer per kind: the first length compiles a
    static graph, the second one dynamic graph that every later length reuses (dynamo's automatic
    dynamic shapes; nothing needs ``mark_dynamic``), with no break on the dynamic path either."""
    model = _build(SPEC_BY_NAME[family])
    by_layer: dict[int, list[tuple[nn.Module, tuple, dict]]] = {}
    for seq in (16, 24, 32, 40):
        segments = torch.tensor([[1] * (seq // 2) + [2] * (seq // 2 - 2) + [0] * 2] * 2)
        batch = {"input_ids": torch.randint(0, model.config.vocab_size, segments.shape)}
        if packed:
            batch |= {"position_ids": packed_positions(segments), "segment_ids": segments}
        for call in layer_calls(model, batch):
            by_layer.setdefault(id(call[0]), []).append(call)
    dynamo.utils.counters.clear()
    for calls in by_layer.values():
        backend = _CountingBackend()
        compiled = torch.compile(calls[0][0], backend=backend)
        for _, args, kwargs in calls:
            compiled(*_detached(args, requires_grad=True), **kwargs).sum().backward()
        assert len(calls) == 4 and backend.graphs <= 2, (type(calls[0][0]).__name__, backend.graphs)
    assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])


def test_expert_counts_equal_bincount():
    from meshforge.models.common.moe import expert_counts

    indices = torch.tensor([[0, 3], [3, 5], [5, 0], [3, 0]])  # experts 1, 2, 4, 6, 7 get nothing
    counts = expert_counts(indices, 8)
    assert counts.dtype == torch.long
    assert torch.equal(counts, torch.bincount(indices.reshape(-1), minlength=8))


@pytest.mark.slow  # several seconds of tracing per case: the full suite runs it
@pytest.mark.parametrize("path", ["loop", "grouped_mm"])
def test_compiled_moe_layer_gives_the_eager_numbers(path: str):
    """Traced through AOTAutograd (the per-expert loop on unbacked sizes, or grouped_mm in
    bfloat16), an MoE layer's output and gradients are bitwise those of the eager layer."""
    grouped = path == "grouped_mm"
    model = _build(SPEC_BY_NAME["qwen3_moe"], torch.bfloat16 if grouped else torch.float32)
    model.configure_kernels(KernelOptions(grouped_mm=grouped))
    (layer, args, kwargs), *_ = layer_calls(model)
    results = []
    for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad(set_to_none=True)
        inputs = _detached(args, requires_grad=True)
        out = run(*inputs, **kwargs)
        out.float().square().sum().backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        results.append([out.detach(), inputs[0].grad, *grads])
    eager, compiled = results
    assert len(eager) == len(compiled) > 6
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
