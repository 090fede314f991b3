"""Find the files meshforge ships (demo configs, tiny tokenizer, corpus) wherever it is installed.

A wheel carries them under `meshforge/_data/`; an editable install (the `make` targets) reads them
from the repository root. YAML paths that start with `meshforge://` name these files, so the demo
config runs from any working directory, while ordinary relative paths resolve against the
working directory as users expect.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_SCHEME = "meshforge://"


def data_root() -> Path:
    """Return the folder that holds `assets/` and `configs/` for this installation."""
    package = Path(__file__).resolve().parent.parent
    packaged = package / "_data"
    if (packaged / "assets").is_dir():
        return packaged
    repo = package.parent.parent
    if (repo / "assets").is_dir():
        return repo
    raise FileNotFoundError(
        f"meshforge's bundled files were not found under {packaged} or {repo}; reinstall meshforge"
    )


def resolve_path(value: str | Path) -> Path:
    """Resolve a user path: `meshforge://assets/x` -> the bundled file, anything else -> cwd-relative."""
    text = str(value)
    if text.startswith(BUILTIN_SCHEME):
        return data_root() / text[len(BUILTIN_SCHEME) :]
    return Path(text).expanduser().resolve()


def builtin_config(name: str) -> Path:
    """Path of a config shipped in `configs/` (e.g. `demo` -> configs/demo.yaml)."""
    path = data_root() / "configs" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no built-in config named {name!r} (looked for {path})")
    return path
