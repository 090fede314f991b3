"""The import structure of `src/meshforge`: no circles, no forbidden arrows.

Reads every module's imports with `ast` (module level and inside functions, because a
function-level import is still an arrow a reader must follow; imports under
`if TYPE_CHECKING:` are left out, since they never run). An import of `pkg.mod.name` counts as an
arrow to `pkg.mod.name` when that is a module, else to `pkg.mod`.

The rules (docs/architecture.md, "Layers"):
- no circle between modules;
- `parallel` never imports a model family (`models.<family>`), only `models.common`, the spec
  protocol and the registry;
- `checkpoint`, `models`, `parallel`, `data` and `optim` never import the trainer;
- `models` and `data` never import each other;
- `config` imports neither torch nor transformers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "meshforge"


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


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(module: str) -> set[str]:
    """The names `module` imports at run time: meshforge modules resolved, others as written."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in _runtime_nodes(tree):
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
    return found


def internal_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = set()
        for name in imports_of(module):
            # `import meshforge.a.b` names the module itself; keep only meshforge modules.
            if name in MODULES and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def _family_packages() -> set[str]:
    """`meshforge.models.<family>`: every sub-package of models except `common`."""
    models = SRC / PACKAGE / "models"
    return {
        f"{PACKAGE}.models.{p.name}"
        for p in models.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "common"
    }


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_trainer(module: str) -> bool:
    """The trainer's modules, less the two contracts components implement (callbacks, section)."""
    return _in(module, f"{PACKAGE}.train") and module not in (
        f"{PACKAGE}.train.callbacks",
        f"{PACKAGE}.train.config",
    )


def forbidden_arrows() -> list[str]:
    families = _family_packages()
    problems = []
    for module in MODULES:
        names = imports_of(module)
        for name in sorted(names):
            arrow = f"{module} -> {name}"
            if _in(module, f"{PACKAGE}.parallel") and any(_in(name, f) for f in families):
                problems.append(f"{arrow} (parallel imports a model family; ask its FamilySpec)")
            if _is_trainer(name) and any(
                _in(module, f"{PACKAGE}.{pkg}")
                for pkg in ("checkpoint", "models", "parallel", "data", "optim")
            ):
                problems.append(f"{arrow} (a component imports the trainer)")
            if _in(module, f"{PACKAGE}.models") and _in(name, f"{PACKAGE}.data"):
                problems.append(f"{arrow} (models import data)")
            if _in(module, f"{PACKAGE}.data") and _in(name, f"{PACKAGE}.models"):
                problems.append(f"{arrow} (data imports models)")
            if _in(module, f"{PACKAGE}.config") and name.split(".")[0] in ("torch", "transformers"):
                problems.append(f"{arrow} (config must stay light)")
    return problems


def test_every_module_is_seen() -> None:
    assert f"{PACKAGE}.train.trainer" in MODULES and f"{PACKAGE}.config.root" in MODULES
    assert len(MODULES) > 100


def test_no_import_circles() -> None:
    cycles = find_cycles(internal_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_forbidden_arrows() -> None:
    problems = forbidden_arrows()
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


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


def test_reader_sees_function_level_imports_and_skips_type_checking(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from meshforge.train.trainer import Trainer\n"
        "def f():\n    from meshforge.models import registry\n"
    )
    tree = ast.parse(source)
    seen = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            seen.add(node.module)
    assert seen == {"typing", "meshforge.models"}
