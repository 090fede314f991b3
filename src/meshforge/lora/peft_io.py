"""PEFT adapter folders both ways, and the merged Hugging Face export.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors` whose keys are
`base_model.model.<HF module path>.lora_A.weight` / `.lora_B.weight` (PEFT drops the adapter
name, `default`, when it saves). The module paths are the Hugging Face ones: each adapted
linear's `<path>.weight` goes through the family's HF adapter to find its key on disk, so a
family whose in-memory names differ from its safetensors keys still writes PEFT's keys.

Exports are collective (sharded adapters are gathered one matrix at a time); rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshforge.lora.apply import LoraSettings
from meshforge.lora.layer import adapters_detached, full_delta, lora_linears

if TYPE_CHECKING:
    from meshforge.models.registry import FamilySpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
KEY = "lora_config.adapter_path"


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def hf_module_paths(model: nn.Module, family: FamilySpec) -> dict[str, str]:
    """Our module path -> the Hugging Face module path, for every adapted linear.

    Raises:
        ValueError: when a target's weight is stored fused with others on disk (no PEFT key exists).
    """
    from meshforge.checkpoint.hf import hf_adapter

    adapter = hf_adapter(family, getattr(model, "config", None))
    out: dict[str, str] = {}
    for path, _ in lora_linears(model):
        keys = adapter.hf_sources(f"{path}.weight")
        if len(keys) != 1 or not keys[0].endswith(".weight"):
            raise ValueError(
                f"lora_config.target_modules: {path!r} is stored as {keys} in Hugging Face checkpoints; "
                "a PEFT adapter needs one linear per module"
            )
        out[path] = keys[0].removesuffix(".weight")
    return out


def _full(param: torch.Tensor) -> torch.Tensor:
    tensor = param.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.cpu()


def adapter_config(settings: LoraSettings, targets: list[str], base_model: str) -> dict[str, object]:
    """The `adapter_config.json` body PEFT reads (`peft.LoraConfig` fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        # Full module paths: PEFT matches a list entry equal to a module's path.
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


@torch.no_grad()
def save_peft_adapter(
    model: nn.Module, family: FamilySpec, out_dir: str | Path, *, settings: LoraSettings, base_model: str
) -> Path:
    """Write the adapters as a PEFT folder that `peft.PeftModel.from_pretrained` loads (collective)."""
    from meshforge.checkpoint.safetensors_file import write_safetensors

    paths = hf_module_paths(model, family)
    tensors: dict[str, torch.Tensor] = {}
    for path, linear in lora_linears(model):
        for part in ("lora_A", "lora_B"):
            sub = linear.get_submodule(part)
            assert isinstance(sub, nn.Linear)
            tensors[f"{PEFT_PREFIX}{paths[path]}.{part}.weight"] = _full(sub.weight).contiguous()
    out = Path(out_dir)
    if _is_main():
        out.mkdir(parents=True, exist_ok=True)
        write_safetensors(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        body = adapter_config(settings, list(paths.values()), base_model)
        (out / ADAPTER_CONFIG).write_text(json.dumps(body, indent=2) + "\n")
    _barrier()
    return out


def _read_adapter_config(folder: Path) -> dict[str, object]:
    from meshforge.checkpoint.readers import read_json_object

    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{KEY}: {folder} has no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    return read_json_object(file)


def check_adapter_config(folder: Path, settings: LoraSettings) -> dict[str, object]:
    """The folder's adapter config, checked against `lora_config` (rank, alpha, plain LoRA).

    Raises:
        ValueError: naming the file and the `lora_config` key to change.
    """
    body = _read_adapter_config(folder)
    file = folder / ADAPTER_CONFIG
    if body.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type is {body.get('peft_type')!r}; only LORA adapters load")
    for flag in ("use_dora", "use_rslora"):
        if body.get(flag):
            raise ValueError(f"{file}: {flag} is true; only plain LoRA (alpha / r scaling) adapters load")
    if body.get("fan_in_fan_out"):
        raise ValueError(f"{file}: fan_in_fan_out is true (Conv1D layers); meshforge adapts nn.Linear only")
    for theirs, ours, value in (
        ("r", "lora_rank", settings.rank),
        ("lora_alpha", "lora_alpha", settings.alpha),
    ):
        if body.get(theirs) != value:
            raise ValueError(
                f"{file}: {theirs} is {body.get(theirs)!r} but lora_config.{ours} is {value}; set "
                f"lora_config.{ours}: {body.get(theirs)!r} to continue training this adapter"
            )
    return body


@torch.no_grad()
def load_peft_adapter(
    model: nn.Module,
    family: FamilySpec,
    folder: str | Path,
    *,
    settings: LoraSettings,
    partial: bool = False,
    log: Callable[[str], None] | None = None,
) -> int:
    """Copy a PEFT adapter folder's A and B matrices into the model's adapters, in place.

    Args:
        partial: the model is one pipeline stage: adapters of other stages' layers are skipped.

    Returns:
        The number of matrices loaded.

    Raises:
        FileNotFoundError / ValueError: naming the folder or file, a key with no adapter in the
            model (or the reverse), and a shape that does not match (an adapter for another base).
    """
    from meshforge.checkpoint.readers import open_safetensors

    src = Path(folder).expanduser().resolve()
    check_adapter_config(src, settings)
    file = src / ADAPTER_WEIGHTS
    if not file.is_file():
        pickled = " (adapter_model.bin is a pickle, which can carry code: never read)"
        raise FileNotFoundError(
            f"{KEY}: {src} has no {ADAPTER_WEIGHTS}{pickled if (src / 'adapter_model.bin').is_file() else ''}"
        )
    ours = {hf: path for path, hf in hf_module_paths(model, family).items()}
    linears = dict(lora_linears(model))
    loaded = 0
    with open_safetensors(file) as handle:
        keys = set(handle.keys())
        wanted: dict[str, tuple[str, str]] = {}
        for key in sorted(keys):
            body = key.removeprefix(PEFT_PREFIX)
            module, _, tail = body.rpartition(".lora_")
            part = f"lora_{tail.removesuffix('.weight').removesuffix('.default')}"
            if not module or part not in ("lora_A", "lora_B"):
                raise ValueError(f"{file}: key {key!r} is not a LoRA A/B matrix")
            if module not in ours:
                if partial:
                    continue
                raise ValueError(
                    f"{file}: {key!r} adapts {module!r}, which lora_config.target_modules does not select "
                    f"here (adapted: {sorted(ours)[:4]} ...)"
                )
            wanted[key] = (ours[module], part)
        found = {(path, part) for path, part in wanted.values()}
        missing = [f"{p}.{part}" for p in linears for part in ("lora_A", "lora_B") if (p, part) not in found]
        if missing:
            raise ValueError(f"{file}: no weights for {len(missing)} adapter matrices, e.g. {missing[:3]}")
        for key, (path, part) in wanted.items():
            sub = linears[path].get_submodule(part)
            assert isinstance(sub, nn.Linear)
            stored = handle.get_tensor(key)
            param = sub.weight
            if tuple(stored.shape) != tuple(param.shape):
                raise ValueError(
                    f"{file}: {key!r} has shape {tuple(stored.shape)}, the model's {path}.{part} needs "
                    f"{tuple(param.shape)} (an adapter for another base model or rank?)"
                )
            stored = stored.to(param.dtype)
            if isinstance(param, DTensor):
                shard = distribute_tensor(stored, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(stored)
            loaded += 1
    if log is not None:
        log(f"lora: loaded {loaded} adapter matrices from {src} ({KEY})")
    return loaded


@contextlib.contextmanager
def merged_weights(model: nn.Module) -> Iterator[None]:
    """Base weights with `alpha / r * B @ A` added and the adapters taken off, for the duration.

    The original local shards are kept and put back bitwise afterwards. Collective.
    """
    saved: list[tuple[nn.Linear, torch.Tensor]] = []
    with torch.no_grad():
        for _, linear in lora_linears(model):
            delta = full_delta(linear)
            weight = linear.weight
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            saved.append((linear, local.detach().clone()))
            if isinstance(weight, DTensor):
                delta_local = distribute_tensor(
                    delta, weight.device_mesh, weight.placements, src_data_rank=None
                ).to_local()
            else:
                delta_local = delta
            local.copy_((local.float() + delta_local.to(local.device)).to(local.dtype))
    try:
        with adapters_detached(model):
            yield
    finally:
        with torch.no_grad():
            for linear, original in saved:
                weight = linear.weight
                local = weight.to_local() if isinstance(weight, DTensor) else weight
                local.copy_(original)


def save_merged_hf(
    model: nn.Module,
    family: FamilySpec,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    collective: bool = True,
) -> Path:
    """A Hugging Face folder of the base model with the adapters merged in (transformers loads it alone)."""
    from meshforge.checkpoint.hf import save_hf

    with merged_weights(model):
        return save_hf(model, family, out_dir, tokenizer=tokenizer, collective=collective)
