"""Every built-in family's spec gives what the rest of meshforge asks of it, and code outside
``models/`` reaches families only through their specs (no import of ``models/<family>``, no
models <-> parallel circle)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.causal_lm import MoECausalLM
from meshforge.models.common.moe import ExpertsBase
from meshforge.models.common.stage import StageBatch
from meshforge.models.registry import SPECS, built_families, kv_cache_families, resolve_family, spec_of_model
from meshforge.models.spec import GENERIC, CPModules, FamilySpec, HFStateDictAdapter, KVCacheModules
from meshforge.models.vocab import vocab_plan

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "meshforge"
FAMILIES = sorted(built_families())


def _build(spec: FamilySpec) -> nn.Module:
    return spec.build({"flavor": "tiny"}, device="meta")


def test_registry_lists_one_spec_per_family_folder():
    folders = sorted(p.parent.name for p in (PACKAGE / "models").glob("*/spec.py"))
    # The transformers path's spec is built per model folder (generic_family), so the registry
    # holds only its folder-less FAMILY, for spec_of_model, outside SPECS.
    assert folders == sorted([*FAMILIES, GENERIC])
    assert [spec.name for spec in SPECS] == [resolve_family(model_type=s.name).name for s in SPECS]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_ships_a_runnable_config(name: str):
    """``configs/<family>/`` holds at least one example that selects the family (trained by
    ``tests/unit/test_example_configs.py``, validated by ``test_configs_dir.py``)."""
    from meshforge.config import load_config
    from meshforge.models.registry import find_family

    configs = sorted((SRC.parent / "configs" / name).glob("*.yaml"))
    assert configs, f"configs/{name}/ has no example"
    chosen = []
    for path in configs:
        model = load_config(path).model
        chosen.append(find_family(model.model_type, model.architectures, model.model_id))
    assert resolve_family(model_type=name) in chosen, configs


def test_model_ids_are_mindspeed_model_ids():
    """A spec's ``model_ids`` select it from ``model.model_id``, which takes MindSpeed's values only."""
    from meshforge.models.config import MS_MODEL_IDS

    for spec in SPECS:
        assert set(spec.model_ids) <= set(MS_MODEL_IDS), (spec.name, spec.model_ids)
        assert all(resolve_family(model_id=m) is spec for m in spec.model_ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_spec_gives_every_piece(name: str):
    spec = resolve_family(model_type=name)
    model = _build(spec)
    assert spec_of_model(model) is spec

    # HF adapter: the protocol's members, bound to the model's args.
    adapter = spec.hf_adapter(model.config)
    for member in ("architecture", "ignored_keys", "renames_only"):
        assert hasattr(adapter, member), member
    hf_adapter: HFStateDictAdapter = adapter
    names = [n for n, _ in model.named_parameters()]
    assert all(hf_adapter.hf_sources(n) for n in names)
    body = hf_adapter.to_hf_config(model.config)
    assert body["model_type"] == name and body["architectures"] == [spec.hf_architectures[0]]
    options = hf_adapter.from_hf_config(body)
    assert spec.parse_options(options).to_hf_dict() == model.config.to_hf_dict()

    # TP plan: module paths of this model, each a ParallelStyle.
    assert spec.tp_plan is not None
    plan = spec.tp_plan(model, tp=1, sequence_parallel=True, loss_parallel=False)
    modules = dict(model.named_modules())
    assert plan and all(isinstance(style, ParallelStyle) for style in plan.values())
    assert set(plan) <= set(modules), sorted(set(plan) - set(modules))[:3]

    # Pipeline stage preparation: runs the real layers like the model's own forward does.
    assert spec.stage_preparation is not None
    real = spec.build({"flavor": "tiny"}, device="cpu")
    ids = torch.randint(0, real.config.vocab_size, (1, 8))
    inner = real.model
    h = inner.embed_tokens(ids)
    layers = list(inner.layers)
    run = spec.stage_preparation(StageBatch(inner, ids, h, None, None, 8, layers))
    for layer in layers:
        h = run(layer, h)
    expected = real(ids)
    got = real.lm_head(inner.norm(h))
    assert ((got - expected).norm() / expected.norm()).item() < 1e-6

    # Context parallelism: the modules CP switches exist in the model, unless the family refuses
    # every method (mamba3's recurrence), saying why.
    kinds = [type(m) for m in model.modules()]
    if spec.cp_methods == ():
        assert spec.cp_modules is None and spec.cp_refusal
    else:
        assert spec.cp_modules is not None
        targets = spec.cp_modules()
        assert isinstance(targets, CPModules)
        assert any(issubclass(k, targets.decoders) for k in kinds)
        switched = targets.attentions + targets.mixers
        assert any(issubclass(k, switched) for k in kinds)
        if spec.cp_methods is not None:
            assert spec.cp_refusal

    # Experts: a model with routed experts has a MoESpec naming their container, and only then.
    routed = isinstance(model, MoECausalLM) or any(issubclass(k, ExpertsBase) for k in kinds)
    assert (spec.moe is not None) == routed
    if spec.moe is not None:
        assert spec.moe.expert_count_key.startswith("model.")
        key = spec.moe.expert_count_key.removeprefix("model.")
        assert key in spec.option_keys, key
        expert_type = spec.moe.expert_type()
        assert any(issubclass(k, expert_type) for k in kinds)

    # Generation cache: the spec's modules are the model's, and the cache takes the model.
    from meshforge.infer.kv_cache import cache_support

    if spec.kv_cache is None:
        assert name not in kv_cache_families() and cache_support(model) is not None
    else:
        cached = spec.kv_cache()
        assert isinstance(cached, KVCacheModules) and name in kv_cache_families()
        assert isinstance(model.model, cached.decoders)
        assert (cached.new_state is None) == (not cached.recurrent)
        assert cache_support(model) is None, cache_support(model)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.cp_methods is not None], ids=lambda s: s.name)
def test_config_refuses_the_cp_methods_the_spec_refuses(spec: FamilySpec):
    """`config/rules.py` reads the refusals from the specs: each refused method fails at load, naming
    the key and the spec's reason; a method the family runs loads."""
    from meshforge.config import config_from_dict
    from meshforge.config.base import ConfigError
    from meshforge.parallel.config import ParallelismConfig

    field = ParallelismConfig.model_fields["context_parallel_method"]
    methods = [m for m in get_args(field.annotation) if m != "ring"]  # ring: colossal's alias
    runs = [m for m in methods if spec.cp_refused(m) is None]
    for method in methods:
        refused = spec.cp_refused(method)
        section = {"context_parallel": 2, "context_parallel_method": method}
        if method == "hybrid":
            section |= {"context_parallel": 4, "ulysses_degree_in_cp": 2}
        data = {"model": {"model_type": spec.name}, "parallelism": section}
        if refused is None:
            config_from_dict(data)
            continue
        key, why = refused
        assert why.endswith(spec.cp_refusal)
        with pytest.raises(ConfigError) as err:
            config_from_dict(data)
        assert f"{key}: not supported yet: context_parallel > 1 for {spec.name}: " in str(err.value)
        assert spec.cp_refusal in str(err.value)
    assert runs == list(spec.cp_methods), (runs, spec.cp_methods)


def test_generic_spec_gives_every_piece_parallel_asks(tmp_path: Path):
    """The transformers path's spec: one per folder, the same pieces as the registry's ``FAMILY``."""
    transformers = pytest.importorskip("transformers")
    from meshforge.models.generic.spec import FAMILY, generic_family
    from meshforge.utils.patterns import match_modules

    config = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=None,
        architectures=["MistralForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    family = generic_family(tmp_path, config.to_dict(), trust_remote_code=False)
    assert family.name == "mistral" and family.hf_architectures == ("MistralForCausalLM",)
    torch.manual_seed(0)
    model = family.build({}, device="cpu")
    assert spec_of_model(model) is FAMILY and FAMILY.name == GENERIC
    pieces = ("pattern_tp_plan", "stage_check", "stage_preparation", "cp_apply", "ep_adapter", "adapter")
    assert all(getattr(family, p) is getattr(FAMILY, p) is not None for p in pieces)
    assert family.tp_plan is None and family.cp_modules is None and not family.fsdp_layer_units

    # TP: styles for exactly the matched modules; a module matched both ways is refused by key.
    assert family.pattern_tp_plan is not None
    col = match_modules(model, ["*.q_proj"], key_path="parallelism.tp_colwise")
    row = match_modules(model, ["*.o_proj"], key_path="parallelism.tp_rowwise")
    plan = family.pattern_tp_plan(model, tp=2, colwise=col, rowwise=row, loss_parallel=False)
    assert sorted(plan) == sorted(name for name, _ in col + row)
    assert all(isinstance(style, ParallelStyle) for style in plan.values())
    with pytest.raises(ValueError, match="tp_colwise and parallelism.tp_rowwise both match"):
        family.pattern_tp_plan(model, tp=2, colwise=col, rowwise=col, loss_parallel=False)

    # PP: the layout is accepted, and a stage runs the layers as the model's own forward does.
    assert family.stage_check is not None and family.stage_preparation is not None
    family.stage_check(model)
    ids = torch.randint(0, 64, (1, 8))
    inner = model.model
    layers = list(inner.layers)
    inner.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
    h = inner.embed_tokens(ids)
    run = family.stage_preparation(StageBatch(inner, ids, h, None, None, 8, layers, model))
    for layer in layers:
        h = run(layer, h)
    got = model.lm_head(inner.norm(h))
    inner.layers = torch.nn.ModuleList(layers)
    expected = model(ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-6

    # EP: the adapter refuses a module that is not transformers' fused experts, naming it.
    assert family.ep_adapter is not None
    adapter = family.ep_adapter()
    with pytest.raises(
        NotImplementedError, match=r"MistralMLP \(model\.layers\.0\.mlp, parallelism\.ep_modules\)"
    ):
        adapter.check("model.layers.0.mlp", model.model.layers[0].mlp)
    with pytest.raises(NotImplementedError, match="alltoall_deredundancy.*use alltoall"):
        adapter.check_dispatcher("alltoall_deredundancy")
    adapter.check_dispatcher("alltoall")


def test_cp_method_refusal_comes_from_the_spec():
    from meshforge.parallel.context import apply_cp

    spec = resolve_family(model_type="qwen3_next")
    assert spec.cp_methods == ("ulysses",)
    model = _build(spec)

    class _Mesh:
        ndim = 1

        def size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError, match="context_parallel_method colossal: its Gated DeltaNet"):
        apply_cp(model, _Mesh(), method="colossal")  # type: ignore[arg-type]


def test_tp_refuses_an_unknown_family_naming_the_built_ones():
    from meshforge.parallel.tensor import apply_tp

    class _Mesh:
        def size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError, match="family 'mamba'.*qwen3"):
        apply_tp(nn.Linear(2, 2), _Mesh(), family="mamba")  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Added:
    new_ids: dict[str, int] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    requested: bool = True

    @property
    def num_added(self) -> int:
        return len(self.new_ids)


class _Tokenizer:
    def __len__(self) -> int:
        return 70


def test_vocab_plan_takes_the_added_tokens_as_an_argument():
    with pytest.raises(ValueError, match="model.resize_vocab"):
        vocab_plan(_Tokenizer(), 64, resize_vocab=False)
    plan = vocab_plan(_Tokenizer(), 64, resize_vocab=False, added=_Added({"<x>": 69}, {"<x>": "x"}))
    assert plan.new_vocab_size == 128


# ------------------------------------------------------------------------------ import arrows
def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """meshforge modules ``path`` imports, at module level or inside functions (not for typing only)."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only.update(id(sub) for sub in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in out if name.startswith("meshforge.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        graph[name] = {r for t in _imports(path) if (r := resolve(t)) and r != name}
    return graph


def test_code_outside_models_reaches_families_only_through_their_specs():
    """``parallel/``, ``infer/`` (the KV cache), the trainer, ...: no import of ``models/<family>``."""
    families = {f"meshforge.models.{name}" for name in FAMILIES}
    bad = [
        (module, target)
        for module, targets in _graph().items()
        if not module.startswith("meshforge.models")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in families)
    ]
    assert not bad, bad


def test_models_import_neither_parallel_nor_data():
    bad = [
        (module, target)
        for module, targets in _graph().items()
        if module.startswith("meshforge.models")
        for target in targets
        if target.startswith(("meshforge.parallel", "meshforge.data"))
    ]
    assert not bad, bad


def test_no_import_circle_through_models_or_parallel():
    graph = _graph()
    scope = {m for m in graph if m.startswith(("meshforge.models", "meshforge.parallel"))}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node] & scope):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(scope):
        if start not in state:
            circle = visit(start)
            assert circle is None, " -> ".join(circle)
