"""Whether a complete-looking checkpoint can be loaded whole, checked before anything is read.

A `COMPLETE` marker says every rank finished writing; it cannot say that the files are still
whole afterwards (a disk that lost a block, a copy that stopped half way, a file removed by hand).
Each save therefore writes `manifest.json` (every file of the folder and its size, by rank 0 once
every rank has written, before the marker), and `damage()` compares the folder with it, reads
`.metadata` and `trainer_state.json` without unpickling code, and checks that every byte range
the metadata names lies inside its data file. Folders written before the manifest existed get
the metadata checks only. Nothing here reads tensor data: a check costs one `stat` per file.

A run resuming with `checkpoint.load_path: auto` (or naming its run folder) falls back to the
newest sound checkpoint and says which file of the newer ones was bad; a named step folder that
is damaged is an error naming the file. A checkpoint is never loaded in part.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.checkpoint.dcp_reader import read_dcp_metadata
from meshforge.checkpoint.trainer_state import read_trainer_state

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

MANIFEST_FILE = "manifest.json"
# Written after the manifest; not listed in it.
_UNLISTED = frozenset({MANIFEST_FILE, "COMPLETE"})


def write_manifest(step_dir: Path) -> None:
    """Record every file of a step folder and its size (rank 0, after every rank has written)."""
    files = {
        path.relative_to(step_dir).as_posix(): path.stat().st_size
        for path in sorted(step_dir.rglob("*"))
        if path.is_file() and path.name not in _UNLISTED
    }
    (step_dir / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _manifest_damage(step_dir: Path) -> str | None:
    path = step_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        listed = json.loads(path.read_text())["files"]
        sizes = {str(name): int(size) for name, size in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path}: unreadable ({type(err).__name__}: {err})"
    for name, size in sizes.items():
        file = step_dir / name
        if not file.is_file():
            return f"{file}: missing (the save wrote it: {MANIFEST_FILE} lists it)"
        found = file.stat().st_size
        if found != size:
            return f"{file}: {found:,} bytes where the save wrote {size:,} (truncated or changed)"
    return None


def _data_files_damage(step_dir: Path, metadata: Metadata) -> str | None:
    ends: dict[str, int] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        ends[name] = max(ends.get(name, 0), end)
    for name, end in sorted(ends.items()):
        file = step_dir / name
        if not file.is_file():
            return f"{file}: missing (.metadata names it)"
        size = file.stat().st_size
        if size < end:
            return f"{file}: {size:,} bytes where .metadata needs {end:,} (truncated)"
    return None


def damage(step_dir: Path) -> str | None:
    """What is wrong with a complete step folder, starting with the bad file's path; None when it
    loads whole. The readers' own messages come first (they say what is wrong inside a file),
    then the sizes against the manifest and against the byte ranges of `.metadata`."""
    try:
        metadata = read_dcp_metadata(step_dir)
        read_trainer_state(step_dir)
    except (OSError, ValueError) as err:
        return str(err)
    return _manifest_damage(step_dir) or _data_files_damage(step_dir, metadata)


def newest_sound(
    steps: list[tuple[int, Path]], *, log: Callable[[str], None] | None = None
) -> tuple[int, Path] | None:
    """The newest of `steps` (oldest first, all complete) that loads whole; each damaged newer
    one is logged with its bad file. None when every one is damaged."""
    for step, path in reversed(steps):
        found = damage(path)
        if found is None:
            return step, path
        if log is not None:
            log(f"checkpoint: skipping damaged step {step}: {found}")
    return None
