"""`make readme-check` reads README.md's shell blocks as a user would copy them.

The check itself (every command run in a copy of the tracked tree) is `make readme-check`, part
of `.ci/run`; this test keeps its reading of the blocks right and the README free of commands
that name files nobody makes.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_commands", REPO / "scripts" / "readme_commands.py")
assert _spec is not None and _spec.loader is not None
readme = importlib.util.module_from_spec(_spec)
sys.modules["readme_commands"] = readme  # its dataclass looks its module up
_spec.loader.exec_module(readme)


def test_blocks_are_read_as_commands_with_their_lines() -> None:
    text = (
        "intro\n```bash\n# a comment\nmeshforge train --config a.yaml \\\n    --training.steps 2  # why\n\n"
        "echo 'x # y'\n```\n```yaml\nnot: run\n```\n```bash\nmake demo\n```\n"
    )
    found = readme.readme_commands(text)
    assert [(c.line, shlex.split(c.text, comments=True)[:2]) for c in found] == [
        (4, ["meshforge", "train"]),
        (7, ["echo", "x # y"]),
        (13, ["make", "demo"]),
    ]
    assert shlex.split(found[0].text, comments=True)[-2:] == ["--training.steps", "2"]


def test_every_yaml_a_readme_command_names_is_shipped_or_made_before() -> None:
    made: set[str] = set()
    for command in readme.readme_commands((REPO / "README.md").read_text(encoding="utf-8")):
        words = shlex.split(command.text, comments=True)
        if words[0] == "cp":
            made.add(words[-1])
        for i, word in enumerate(words):
            if word.endswith(".yaml") and not (i and words[i - 1] in ("-o", "--output")) and word not in made:
                assert (REPO / word).is_file(), (
                    f"README.md:{command.line}: {word} is neither shipped nor made"
                )
