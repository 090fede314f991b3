"""Every module of `src/meshforge` stays at 600 lines or fewer (DESIGN.md: small modules with one
purpose each); a module that grows past it is split, not stretched."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"
MAX_LINES = 600


def test_no_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(SRC)): count
        for path in sorted(SRC.rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
