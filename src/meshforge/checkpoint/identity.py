"""Is a checkpoint one of this model? Checked from its DCP metadata before any tensor is read.

DCP loads by name: a checkpoint of another family whose shared names have the same shapes loads
silently (the names it has and the model lacks are ignored), and one of another size fails deep
inside the read with a size error. Comparing the model's state-dict names and global shapes with
the checkpoint's metadata first turns both into one line naming the checkpoint and the first
difference. Pipeline ranks hold different parts of the model: the names the checkpoint has and
the model lacks are judged against the union over the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

PREFIX = "model."  # the key the model's state dict is saved under


def _gathered(names: set[str], found: list[str]) -> tuple[set[str], list[str]]:
    """Every rank's names (a union) and differences (in name order), so all ranks decide alike."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return names, found
    parts: list[tuple[set[str], list[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (names, found))
    every = [part for part in parts if part is not None]
    return set().union(*(n for n, _ in every)), sorted({f for _, fs in every for f in fs})


def model_differences(saved: Metadata, model_sd: Mapping[str, object]) -> list[str]:
    """The differences between the checkpoint's model tensors and the model's, the same list on
    every rank (collective with several ranks: every rank must call it)."""
    stored = {
        key[len(PREFIX) :]: meta
        for key, meta in saved.state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    found: list[str] = []
    for name in sorted(model_sd):
        shape = tuple(getattr(model_sd[name], "shape", ()))
        meta = stored.get(name)
        if meta is None:
            found.append(f"{name} is not in it")
        elif tuple(meta.size) != shape:
            found.append(f"{name} is {list(meta.size)} there and {list(shape)} here")
    everywhere, found = _gathered(set(model_sd), found)
    return found + [f"it holds {name}, which this model has not" for name in sorted(set(stored) - everywhere)]


def check_same_model(path: Path, saved: Metadata, model_sd: Mapping[str, object]) -> None:
    """Raise, naming the checkpoint and its first difference, unless it holds this model.

    Raises:
        ValueError: naming `checkpoint.load_path`.
    """
    found = model_differences(saved, model_sd)
    if not found:
        return
    config = path.parent.parent / "config.yaml"
    hint = f"; it was trained with {config}" if config.is_file() else ""
    more = f" (and {len(found) - 1} more differences)" if len(found) > 1 else ""
    raise ValueError(
        f"checkpoint.load_path: {path} holds another model: {found[0]}{more}. Load it with the model "
        f"section it was saved with{hint}"
    )
