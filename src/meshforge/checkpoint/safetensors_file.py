"""Writing a `.safetensors` file with the permissions of every other file a run writes.

The safetensors library creates its files with mode 0600 whatever the process's umask, so an
export shared with a team (or read by a serving process of another user) would be unreadable to
them while the `config.json` beside it is not. The mode is set afterwards from the umask, as
`open()` would have set it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _umask() -> int:
    """The process's umask, read without changing it where the kernel reports it (Linux): setting
    it to read it back would, for an instant, affect files other threads create (a background
    checkpoint save)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o077)
    os.umask(current)
    return current


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, *, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, then the file's mode set to 0666 minus the umask."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


__all__ = ["write_safetensors"]
