"""The import structure of `src/meshforge`: no circles, package arrows that point one way.

Reads every module's imports with `ast`, module level and inside functions (a function-level
import is still an arrow a reader must follow). Two graphs come out of it: the run-time graph
leaves out the bodies of `if TYPE_CHECKING:` blocks (they never run), the typed graph keeps them
(a type-level circle still means neither module can be read without the other). An import of
`pkg.mod.name` counts as an arrow to `pkg.mod.name` when that is a module, else to `pkg.mod`.

The rules (docs/architecture.md, "Layers"), one test each, every failure naming its arrows:
- no module circle, in either graph;
- no package imports `cli` (but `__main__`); components never import `train` but its two
  torch-free contracts (`train.callbacks`, `train.config`);
- `parallel` reaches `models` only through `models.spec`, `models.registry` and `models.common`
  (and the `model:` section, `models.config`);
- `models` and `data` never import each other;
- `config` and `utils` import, at run time, no component module but the section models and
  (config only) the torch-free facts it validates against; `utils` imports from `config` only its
  base classes; `config` imports neither torch nor transformers;
- no two packages import each other, arrows into the shared contracts aside (the config base
  classes, the section models `config/` composes, the trainer's two contracts).

"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "meshforge"

COMPONENTS = (
    "models",
    "parallel",
    "memory",
    "loss",
    "lora",
    "optim",
    "data",
    "checkpoint",
    "monitor",
    "infer",
)

# Every package may import these: pydantic bases and number rules, and the layer-spec type.
FOUNDATION = frozenset({f"{PACKAGE}.config.base", f"{PACKAGE}.config.layer_spec"})

# The trainer's torch-free contracts that components implement or configure.
TRAIN_CONTRACTS = frozenset({f"{PACKAGE}.train.callbacks", f"{PACKAGE}.train.config"})

# Section models outside a `*/config.py` module, with what they hold.
OTHER_SECTION_MODELS = {
    f"{PACKAGE}.monitor.profiling": "ProfilerConfig beside the profiler it configures",
    f"{PACKAGE}.utils.context_config": "the context section",
    f"{PACKAGE}.train.callbacks": "the callback registry the callbacks section names",
}

# Torch-free component modules `config/` validates against, beyond the section models.
CONFIG_READS = {
    f"{PACKAGE}.models.registry": "model_type / architectures / model_id and each family's keys",
    f"{PACKAGE}.parallel.dims": "the parallel degrees, checked in pure Python",
    f"{PACKAGE}.parallel.float8": "the model.quant_* recipe checks (torchao imported on use)",
    f"{PACKAGE}.optim.specs": "each optimizer's and schedule's passthrough keys",
    f"{PACKAGE}.memory.ops": "the operator words of recompute exclude_op",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, *, typed: bool) -> Iterator[ast.AST]:
    """Every node; without `typed`, the bodies of `if TYPE_CHECKING:` blocks are left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not typed and isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    return _nodes(tree, typed=False)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


@cache
def imports_of(module: str, *, typed: bool = False) -> frozenset[str]:
    """The names `module` imports (at run time, or with `typed` also for type checking)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in _nodes(tree, typed=typed):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module
            if node.level:
                target = _resolve_relative(module, path.name == "__init__.py", node.level, target)
            assert target is not None
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in MODULES else target)
    return frozenset(found)


@cache
def internal_graph(*, typed: bool = False) -> dict[str, frozenset[str]]:
    """module -> the meshforge modules it imports (`import meshforge.a.b` names the module)."""
    return {
        module: frozenset(n for n in imports_of(module, typed=typed) if n in MODULES and n != module)
        for module in MODULES
    }


def arrows(*, typed: bool = False) -> Iterator[tuple[str, str]]:
    for module, targets in sorted(internal_graph(typed=typed).items()):
        for target in sorted(targets):
            yield module, target


def find_cycles(graph: dict[str, set[str]] | dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return components


def package_of(module: str) -> str:
    """The first-level package (`meshforge.data.sft.loader` -> `data`); `__main__` is `cli`."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    return "cli" if parts[1] == "__main__" else parts[1]


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_section_model(module: str) -> bool:
    """A section's config model: `<package>/config.py` (any depth) or a listed module."""
    return (
        module.endswith(".config") and package_of(module) not in ("", "config")
    ) or module in OTHER_SECTION_MODELS


def is_contract_arrow(module: str, target: str) -> bool:
    """An arrow into what several layers share on purpose (no package circle through it).

    The config base classes (every section derives from them), the section models (`config/`
    composes them; a package's own section names its base classes), the trainer's contracts.
    """
    if target in FOUNDATION or target in TRAIN_CONTRACTS:
        return True
    return package_of(module) == "config" and is_section_model(target)


def package_circles(edges: list[tuple[str, str]], allowed: frozenset[frozenset[str]]) -> list[str]:
    """`a <-> b: <every arrow a -> b>; <every arrow b -> a>` for packages importing each other."""
    between: dict[tuple[str, str], list[str]] = {}
    for module, target in edges:
        a, b = package_of(module), package_of(target)
        if a != b and not is_contract_arrow(module, target):
            between.setdefault((a, b), []).append(f"{module} -> {target}")
    return [
        f"{a} <-> {b}: {', '.join(between[a, b])}; {', '.join(between[b, a])}"
        for a, b in sorted(between)
        if a < b and (b, a) in between and frozenset((a, b)) not in allowed
    ]


# Package pairs that may import each other (besides contract arrows): none.
BOTH_WAYS: frozenset[frozenset[str]] = frozenset()


def _check(problems: list[str], what: str) -> None:
    """Fail naming every problem."""
    assert not problems, f"{what}:\n" + "\n".join(problems)


def test_every_module_is_seen() -> None:
    assert f"{PACKAGE}.train.trainer" in MODULES and f"{PACKAGE}.config.root" in MODULES
    assert len(MODULES) > 100
    assert {package_of(m) for m in MODULES} >= {*COMPONENTS, "cli", "train", "config", "utils"}


def test_no_import_circles() -> None:
    cycles = find_cycles(internal_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_type_level_circles() -> None:
    cycles = [" <-> ".join(c) for c in find_cycles(internal_graph(typed=True))]
    _check(cycles, "import circles with TYPE_CHECKING imports")


def test_only_cli_imports_cli_and_components_never_import_the_trainer() -> None:
    problems = []
    for module, target in arrows(typed=True):
        source = package_of(module)
        if package_of(target) == "cli" and source != "cli":
            problems.append(f"{module} -> {target} (only the command imports cli)")
        if source in COMPONENTS and _in(target, f"{PACKAGE}.train") and target not in TRAIN_CONTRACTS:
            problems.append(f"{module} -> {target} (a component imports the trainer)")
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def test_parallel_reaches_models_through_the_spec() -> None:
    allowed = (f"{PACKAGE}.models.spec", f"{PACKAGE}.models.registry", f"{PACKAGE}.models.common")
    problems = [
        f"{module} -> {target} (parallel asks the family's FamilySpec)"
        for module, target in arrows(typed=True)
        if package_of(module) == "parallel"
        and package_of(target) == "models"
        and target != f"{PACKAGE}.models"
        and not any(_in(target, a) for a in allowed)
        and not is_section_model(target)
    ]
    _check(problems, "parallel imports a model module")


def test_models_and_data_never_import_each_other() -> None:
    problems = [
        f"{module} -> {target}"
        for module, target in arrows(typed=True)
        if {package_of(module), package_of(target)} == {"models", "data"}
    ]
    assert not problems, "models and data import each other:\n" + "\n".join(problems)


def test_config_and_utils_import_only_section_models() -> None:
    problems = []
    for module, target in arrows():
        source, dest = package_of(module), package_of(target)
        if source not in ("config", "utils") or dest == source:
            continue
        if source == "utils" and dest == "config" and target not in FOUNDATION:
            problems.append(f"{module} -> {target} (utils imports only config's base classes)")
        if dest in (*COMPONENTS, "train", "cli") and not is_section_model(target):
            if source == "config" and target in CONFIG_READS:
                continue
            problems.append(f"{module} -> {target} (not a section model)")
    assert not problems, "config/utils import a component:\n" + "\n".join(problems)


def test_section_leaves_import_nothing_of_their_package() -> None:
    """`data/config.py` is validated by its registry's parser, handed over on import (no arrow)."""
    leaf = f"{PACKAGE}.data.config"
    inside = sorted(t for t in internal_graph(typed=True)[leaf] if package_of(t) == "data")
    assert not inside, f"{leaf} imports " + ", ".join(inside)


def test_config_stays_light() -> None:
    problems = [
        f"{module} -> {name}"
        for module in MODULES
        if package_of(module) == "config"
        for name in sorted(imports_of(module))
        if name.split(".")[0] in ("torch", "transformers")
    ]
    assert not problems, "config must not import torch or transformers:\n" + "\n".join(problems)


def test_no_package_circles() -> None:
    circles = package_circles(list(arrows()), BOTH_WAYS)
    assert not circles, "packages that import each other:\n" + "\n".join(circles)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(find_cycles(graph)) == expected


def test_package_circles_skip_contract_arrows() -> None:
    m = PACKAGE
    edges = [
        (f"{m}.data.preview", f"{m}.config.root"),
        (f"{m}.config.root", f"{m}.data.config"),  # a section model: no circle
        (f"{m}.data.config", f"{m}.config.base"),
        (f"{m}.memory.comm", f"{m}.parallel.tensor"),
        (f"{m}.parallel.parallelize", f"{m}.memory.apply"),
    ]
    found = package_circles(edges, frozenset())
    assert found == [
        f"memory <-> parallel: {m}.memory.comm -> {m}.parallel.tensor; {m}.parallel.parallelize -> {m}.memory.apply"
    ]
    assert package_circles(edges, frozenset({frozenset(("memory", "parallel"))})) == []


def test_reader_sees_function_level_imports_and_type_checking_only_when_typed() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from meshforge.train.trainer import Trainer\n"
        "def f():\n    from meshforge.models import registry\n"
    )
    tree = ast.parse(source)

    def seen(typed: bool) -> set[str | None]:
        return {n.module for n in _nodes(tree, typed=typed) if isinstance(n, ast.ImportFrom)}

    assert seen(False) == {"typing", "meshforge.models"}
    assert seen(True) == {"typing", "meshforge.models", "meshforge.train.trainer"}
