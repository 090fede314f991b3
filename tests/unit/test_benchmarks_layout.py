"""The benchmark scripts' imports: the shared harness everywhere, no circle, no `sys.path` edit.

Scripts run as `python benchmarks/<script>.py`, so their folder is first on `sys.path` and they
import each other by bare name (`import _harness`). Read with `ast`, function-level imports
included, as `test_layering.py` reads the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_layering import find_cycles

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}
HARNESS = "_harness"


def _tree(name: str) -> ast.Module:
    return ast.parse(SCRIPTS[name].read_text(encoding="utf-8"), filename=str(SCRIPTS[name]))


def local_imports(name: str) -> set[str]:
    """The benchmark modules `name` imports."""
    found = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & set(SCRIPTS)


def touches_sys_path(name: str) -> list[int]:
    """Lines that use `sys.path` (an insert, an append or an assignment all start there)."""
    return [
        node.lineno
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]


def test_the_harness_is_there_and_every_script_uses_it() -> None:
    assert HARNESS in SCRIPTS and len(SCRIPTS) > 10
    missing = [name for name in SCRIPTS if name != HARNESS and HARNESS not in local_imports(name)]
    assert not missing, f"benchmarks that do not import {HARNESS}: {missing}"


def test_the_harness_imports_no_script() -> None:
    assert local_imports(HARNESS) == set()


def test_no_import_circle_between_benchmarks() -> None:
    graph = {name: local_imports(name) - {name} for name in SCRIPTS}
    cycles = find_cycles(graph)
    assert not cycles, "benchmark import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_benchmark_edits_sys_path() -> None:
    edits = {name: lines for name in SCRIPTS if (lines := touches_sys_path(name))}
    assert not edits, f"sys.path used (script: lines): {edits}"


def test_the_readers_see_what_they_look_for(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\nsys.path.insert(0, '.')\ndef f():\n    from _harness import emit\n    import step_variants\n"
    )
    monkeypatch.setitem(SCRIPTS, "probe", script)
    assert local_imports("probe") == {HARNESS, "step_variants"}
    assert touches_sys_path("probe") == [2]
