"""Is a checkpoint one of this model? Checked from its DCP metadata before any tensor is read.

Every step folder records what model it holds in `trainer_state.json` under `model`: the family,
the integer and boolean fields of the model's config (the ones that can give a tensor another
shape or name) and a fingerprint, a hash of every saved tensor's name and global shape. Loading
compares the fingerprints first; when they differ, the tensors are compared (below) and the
refusal names the family or the first config field that differs, else the first tensor.

DCP loads by name: a checkpoint of another family whose shared names have the same shapes loads
silently (the names it has and the model lacks are ignored), and one of another size fails deep
inside the read with a size error. Comparing the model's state-dict names and global shapes with
the checkpoint's metadata first turns both into one line naming the checkpoint and the first
difference. Pipeline ranks hold different parts of the model: the names the checkpoint has and
the model lacks are judged against the union over the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

PREFIX = "model."  # the key the model's state dict is saved under
# Config fields that never change a tensor: token ids, and lengths that only bound positions.
_NOT_SHAPES = re.compile(r"token_id|max_position_embeddings|sliding_window|max_window_layers|seed")
Shapes = dict[str, list[int]]


def config_fields(config: object) -> dict[str, int | bool]:
    """The integer and boolean fields of a model config (a family's args dataclass, or an object
    with `to_dict`, as a transformers config) that can change a tensor's shape or name."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        values: Mapping[str, object] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    elif callable(getattr(config, "to_dict", None)):
        values = config.to_dict()  # type: ignore[attr-defined]
    else:
        return {}
    return {
        key: value
        for key, value in sorted(values.items())
        if isinstance(value, int) and not _NOT_SHAPES.search(key)
    }


def model_shapes(model_sd: Mapping[str, object]) -> Shapes:
    """Every tensor's name and global shape, the union over the ranks (collective with several)."""
    shapes = {name: list(getattr(value, "shape", ())) for name, value in model_sd.items()}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return shapes
    parts: list[Shapes | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shapes)
    return {name: shape for part in parts if part is not None for name, shape in part.items()}


def fingerprint(shapes: Shapes) -> str:
    """A hash of the names and shapes, the same for the same model on any layout."""
    text = json.dumps(sorted(shapes.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def model_record(family: str, config: object, shapes: Shapes) -> dict[str, object]:
    """What `trainer_state.json` records under `model`."""
    return {"family": family, "config": config_fields(config), "fingerprint": fingerprint(shapes)}


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


def _recorded_difference(recorded: object, ours: Mapping[str, object]) -> str | None:
    """The family, else the first config field, that differs between two `model` records."""
    if not isinstance(recorded, Mapping):
        return None  # a checkpoint written before the record existed
    if recorded.get("family") != ours["family"]:
        return f"it holds a {recorded.get('family')} model and this run builds {ours['family']}"
    theirs, mine = recorded.get("config"), ours["config"]
    if not (isinstance(theirs, Mapping) and isinstance(mine, Mapping)):
        return None
    for key in sorted(set(theirs) | set(mine)):
        if theirs.get(key) != mine.get(key):
            return f"model.{key} is {theirs.get(key)} there and {mine.get(key)} here"
    return None


def check_same_model(
    path: Path,
    saved: Metadata,
    model_sd: Mapping[str, object],
    *,
    recorded: object = None,
    ours: Mapping[str, object] | None = None,
) -> None:
    """Raise, naming the checkpoint and its first difference, unless it holds this model.

    Collective with several ranks. `recorded` is the checkpoint's `model` record (absent in
    older checkpoints), `ours` this run's (:func:`model_record`): equal fingerprints settle it.

    Raises:
        ValueError: naming `checkpoint.load_path`.
    """
    if (
        ours is not None
        and isinstance(recorded, Mapping)
        and recorded.get("fingerprint") == ours["fingerprint"]
    ):
        return
    found = model_differences(saved, model_sd)
    if not found:
        return
    named = _recorded_difference(recorded, ours) if ours is not None else None
    config = path.parent.parent / "config.yaml"
    hint = f"; it was trained with {config}" if config.is_file() else ""
    more = f" (and {len(found) - 1} more differences)" if len(found) > 1 else ""
    first = f"{named} ({found[0]}{more})" if named else f"{found[0]}{more}"
    raise ValueError(
        f"checkpoint.load_path: {path} holds another model: {first}. Load it with the model "
        f"section it was saved with{hint}"
    )
