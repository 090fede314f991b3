"""What a LoRA checkpoint records about its frozen base, and loading a base from a full DCP step.

A LoRA step folder holds only what trains (adapters, optimizer, trainer state); its
`trainer_state.json` carries `lora.base`: the folder the base weights came from (a Hugging Face
folder or a full meshforge DCP step) and a SHA-256 over its weight files, so that resuming or
exporting against a changed base is caught instead of silently training another model.

The checkpoint keeps adapters and base weights apart by name (`is_adapter_parameter`), so the
naming rule of the adapter matrices (`lora/layer.py` creates them) is stated here, below both.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TypeVar

import torch.nn as nn

_CHUNK = 1 << 22
V = TypeVar("V")  # a state dict's values (tensors, DTensors, DCP's nested values)


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter matrix (`...lora_A.weight`, `lora_B`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight"


def _weight_files(folder: Path, kind: str) -> list[Path]:
    if kind == "hf":
        return sorted(folder.glob("*.safetensors"))
    return sorted([*folder.glob("*.distcp"), folder / ".metadata"])


def weights_digest(folder: Path, kind: str) -> str:
    """SHA-256 over the weight files' names and bytes (safetensors, or a DCP step's shards)."""
    digest = hashlib.sha256()
    for file in _weight_files(folder, kind):
        if not file.is_file():
            continue
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def base_reference(folder: Path, kind: str) -> dict[str, object]:
    """`{"kind": "hf" | "dcp", "path", "sha256"}` for `trainer_state.json`'s `lora.base`."""
    return {"kind": kind, "path": str(folder), "sha256": weights_digest(folder, kind)}


def check_base(recorded: dict[str, object], where: Path) -> Path:
    """The recorded base folder, after checking it still holds the same weights.

    Raises:
        FileNotFoundError / ValueError: naming the checkpoint and the base folder.
    """
    folder = Path(str(recorded.get("path", "")))
    kind = str(recorded.get("kind", "hf"))
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}: its LoRA base {folder} ({kind}) does not exist any more")
    digest = weights_digest(folder, kind)
    if digest != recorded.get("sha256"):
        raise ValueError(
            f"{where}: the LoRA base {folder} changed since the adapters were trained (SHA-256 "
            f"{digest[:12]} != recorded {str(recorded.get('sha256'))[:12]}); train new adapters on it"
        )
    return folder


def base_state_dict(model_sd: dict[str, V]) -> dict[str, V]:
    """The entries of a model state dict that are base weights (adapters left out)."""
    return {k: v for k, v in model_sd.items() if not is_adapter_parameter(k)}


def adapter_state_dict(model_sd: dict[str, V]) -> dict[str, V]:
    """The adapter entries of a model state dict."""
    return {k: v for k, v in model_sd.items() if is_adapter_parameter(k)}


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter_parameter(name) for name, _ in model.named_parameters())
