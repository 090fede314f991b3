"""The pass of `training.pref_ref_logps: precompute`: fill the reference table once, save it, reuse it.

Rows are dealt over the data-parallel ranks in chunks of `local_batch_size` (as the eval loader
deals them; every rank runs the same number of forwards, so FSDP's collectives pair up), each rank
fills its rows and one all-reduce over the data-parallel group completes the table
(`train/reference_table.py`); every tensor- or expert-parallel rank computes the same values. The
random state is left as it was, so a precomputed run draws the same numbers as a `model` run. The
pass runs after the data and before the optimizer: the frozen copy of a full fine-tuning run is
built for it and freed after it, so training holds one copy of the weights.

Storage. Rank 0 saves the table as `reference_logps-<fingerprint>.npz` in `train_dataset.tokenized_path`
when set (beside the cached pair rows it describes), else in `training.output_dir`. A run (a resume,
a rerun on the same data) whose fingerprint (the rows' contents, the model section and source
files, the seed of a seeded init, `cutoff_len`, the dtypes) matches the file loads it and never
builds the reference model; every rank must find it, else every rank computes it again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from meshforge.train.reference_table import IndexedRows
from meshforge.utils import distributed as dist_utils
from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.config.root import TrainConfig
    from meshforge.train.preference import PreferenceStep
    from meshforge.train.run import ModelParts, RunData, RunEnv

FORMAT = "meshforge reference logps v1"


def _parts(data: RunData) -> dict[str, Any]:
    """The run's pair datasets by name, in table order (train first)."""
    parts: dict[str, Any] = {"train": cast(Any, data.loader).dataset}
    for name, loader in data.eval_loaders.items():
        parts[f"validation:{name}"] = cast(Any, loader).dataset
    for name, rows in parts.items():
        if not hasattr(rows, "flat") or "segment_ids" not in rows.flat:
            raise ValueError(
                f"training.pref_ref_logps: precompute needs in-memory pair rows; the {name} data has none"
            )
    return parts


def fingerprint(cfg: TrainConfig, parts: dict[str, Any], model: ModelParts) -> str:
    """What the table's values depend on: the rows, the model and its source, cutoff, seed, dtypes."""
    digest = hashlib.sha256()
    head = {
        "format": FORMAT,
        "model": cfg.model.model_dump(mode="json"),
        "seed": cfg.training.seed,
        "cutoff_len": cfg.train_dataset.cutoff_len,
        "dtypes": [str(model.params_dtype), str(model.compute_dtype)],
        "parts": list(parts),
    }
    digest.update(json.dumps(head, sort_keys=True, default=str).encode())
    source = cfg.model.model_name_or_path
    if source:
        folder = resolve_path(source)
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path.is_file():
                stat = path.stat()
                digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for rows in parts.values():
        digest.update(np.ascontiguousarray(rows.offsets, dtype=np.int64).tobytes())
        for key in sorted(rows.flat):
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(rows.flat[key]).tobytes())
    return digest.hexdigest()


def table_path(cfg: TrainConfig, env: RunEnv, key: str) -> Path:
    """Beside the cached pair rows (`tokenized_path`) when set, else in the run folder."""
    folder = resolve_path(cfg.train_dataset.tokenized_path) if cfg.train_dataset.tokenized_path else None
    return (
        folder if folder is not None and folder.is_dir() else env.output_dir
    ) / f"reference_logps-{key[:16]}.npz"


def _load(path: Path, key: str, shape: tuple[int, int, int]) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        with np.load(path) as saved:
            if str(saved["fingerprint"]) != key or tuple(saved["sums"].shape) != shape:
                return None
            return np.asarray(saved["sums"], dtype=np.float32)
    except (OSError, KeyError, ValueError):
        return None


def _save(path: Path, key: str, sums: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        np.savez(handle, sums=sums, fingerprint=np.asarray(key))
    os.replace(tmp, path)


def _compute(
    step: PreferenceStep,
    policy: torch.nn.Module,
    parts: dict[str, Any],
    env: RunEnv,
    shape: tuple[int, int, int],
) -> torch.Tensor:
    """Every row's reference sums (`[rows, pairs, 2]`), the rows dealt over the data-parallel ranks."""
    from meshforge.train.batches import to_device

    batch_mesh = env.mesh.view("batch")
    dp_rank, dp_size = batch_mesh.get_local_rank(), env.dims.dp
    local = env.plan.local_batch_size
    table = torch.zeros(shape, dtype=torch.float32, device=env.device)
    offset = 0
    for rows in parts.values():
        count = len(rows)
        for first in range(0, count, dp_size * local):
            indices = np.arange(first + dp_rank * local, first + (dp_rank + 1) * local, dtype=np.int64)
            real = indices < count
            batch = to_device(
                {k: torch.from_numpy(v) for k, v in rows.get_batch(np.where(real, indices, 0)).items()},
                env.device,
                pin=False,
            )
            logps = step.reference_forward(policy, batch)
            pairs = logps.chosen.shape[0] // len(indices)
            sums = torch.stack([logps.chosen, logps.rejected], dim=1).view(len(indices), pairs, 2)
            keep = torch.from_numpy(real).to(env.device)
            where = torch.from_numpy(indices[real] + offset).to(env.device)
            table[where, :pairs] = sums[keep].float()
        offset += count
    group = batch_mesh.get_group() if dp_size > 1 else None
    return dist_utils.all_reduce_sum(table, group) if dp_size > 1 else table


def precompute_reference(
    cfg: TrainConfig,
    env: RunEnv,
    model: ModelParts,
    tokenizer: PreTrainedTokenizerBase,
    step: PreferenceStep,
    data: RunData,
) -> None:
    """Fill `step.table` (load the saved table or compute it) and index the run's loaders; no-op without one."""
    table = step.table
    if table is None:
        return
    parts = _parts(data)
    num_rows = sum(len(rows) for rows in parts.values())
    max_segment = max((int(rows.flat["segment_ids"].max(initial=0)) for rows in parts.values()), default=0)
    shape = (num_rows, max(1, (max_segment + 1) // 2), 2)
    key = fingerprint(cfg, parts, model)
    path = table_path(cfg, env, key)
    start = time.perf_counter()
    sums = _load(path, key, shape)
    # Every rank must have found the file, else every rank computes it (the pass is collective).
    missing = dist_utils.all_reduce_sum(torch.tensor(int(sums is None), device=env.device))
    if int(missing) == 0 and sums is not None:
        table.values = torch.from_numpy(sums).to(env.device)
        env.log(f"preference: reference log-probabilities of {num_rows} rows loaded from {path}")
    else:
        reference = step.reference
        if reference is None and not step.lora:
            from meshforge.train.build_preference import build_reference

            reference = build_reference(cfg, env, tokenizer)
        step.reference = reference  # reference_forward reads the copy, or the policy with adapters off
        accelerator = env.device.type != "cpu"
        devices = [env.device] if accelerator else []
        with torch.random.fork_rng(devices=devices, device_type=env.device.type if accelerator else None):
            values = _compute(step, model.module, parts, env, shape)
        del reference
        if step.lora:
            from meshforge.train.evaluation import reshard_fsdp

            reshard_fsdp(model.module)  # forwards without backward leave FSDP's root unsharded
        table.values = values
        if env.dist.is_main:
            _save(path, key, values.cpu().numpy())
        env.log(
            f"preference: reference log-probabilities of {num_rows} rows computed in "
            f"{time.perf_counter() - start:.1f}s, saved to {path}; the reference model is freed"
        )
    step.reference = None
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    offset = 0
    data.loader.dataset = IndexedRows(parts["train"], offset)  # type: ignore[union-attr]
    offset += len(parts["train"])
    for loader in data.eval_loaders.values():
        rows = cast(Any, loader).dataset
        cast(Any, loader).dataset = IndexedRows(rows, offset)
        offset += len(rows)
