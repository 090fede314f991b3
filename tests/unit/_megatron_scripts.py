"""Launch scripts of tests/data/megatron_scripts/ with their placeholder paths filled in.

The MindSpeed-LLM scripts ship with `CKPT_LOAD_DIR="your model ckpt path"`-style placeholders
that a user replaces; `filled` does the same, and nothing else, into a copy under `tmp`.
"""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "data" / "megatron_scripts"
TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"


def filled(name: str, tmp: Path, paths: dict[str, Path] | None = None) -> Path:
    """A copy of script `name` in `tmp` whose `X="your ..."` paths are `paths[X]` (default: a
    new folder `tmp/X`, the bundled tokenizer for TOKENIZER_PATH)."""
    given = dict(paths or {})

    def fill(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in given:
            given[key] = TOKENIZER if key == "TOKENIZER_PATH" else tmp / key
            if key != "TOKENIZER_PATH":
                given[key].mkdir(parents=True, exist_ok=True)
        return f'{key}="{given[key]}"'

    text = re.sub(r'^(\w+)="your [^"]*"', fill, (SCRIPTS / name).read_text(encoding="utf-8"), flags=re.M)
    out = tmp / name
    out.write_text(text, encoding="utf-8")
    return out
