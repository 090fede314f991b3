"""Readers of the files a checkpoint folder holds, with one-line errors that name the file.

A damaged file (a truncated copy, an interrupted download, a hand edit) must end a run with the
file's path and what is wrong with it, not with the parser's traceback: `meshforge train`
prints `ValueError`/`FileNotFoundError` messages as they are and exits with status 2.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from safetensors import safe_open as SafeOpen

DCP_METADATA_FILE = ".metadata"


def inside_folder(name: str) -> bool:
    """Whether a file name read from a checkpoint or model folder stays inside that folder."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def read_json_object(file: Path) -> dict[str, object]:
    """The JSON object in `file`.

    Raises:
        FileNotFoundError: when `file` does not exist.
        ValueError: naming the file, when it is not valid JSON or holds something else than an object.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not a UTF-8 text file ({err})") from None
    except ValueError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(data).__name__}")
    return data


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[SafeOpen]:
    """`safetensors.safe_open` on the CPU, with a damaged file reported by name.

    safetensors checks the header (and that the data it describes fits in the file) when the
    file is opened, so a truncated file fails here, before any tensor is read.

    Raises:
        ValueError: naming the file and safetensors' reason.
    """
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(
            f"{file}: not a valid safetensors file ({err}); it may be truncated or incompletely "
            "downloaded: copy it again"
        ) from None
    with handle as opened:
        yield opened
