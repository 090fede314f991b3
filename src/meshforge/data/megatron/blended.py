"""Blending several Megatron datasets by weight, and the builder behind `data_path` + `split` + `sizes`.

`data_path` is Megatron's blend list: `['0.3', 'a_text_document', '0.7', 'b_text_document']` (weights
and prefixes) or `['a_text_document', 'b_text_document']` (prefixes only). The rules and their quirks
are Megatron-LM's (megatron-core's `blended_megatron_dataset_builder.py` and `blended_dataset.py`), kept so that a blend means the same here as there:

- An odd-length list is prefixes only. An even-length list is read as (weight, prefix) pairs; when a
  weight is not a number the list is taken as prefixes only, but (Megatron's iterator-reuse quirk)
  only if every weight slot after the first non-number is also a non-number; a number after it is an
  error.
- With weights (normalised), split i of member k is built with `ceil(ceil(size_i * w_k) * 1.005)`
  samples (the surplus), and the blend has `sum_k ceil(size_i * w_k)` samples. One `['1', 'p']` pair
  still makes a one-member blend; a lone prefix makes a bare GPTDataset.
- Without weights, members are built for one epoch, weighted by their lengths, and the blend has
  `min(size_i, total)` samples, or every sample when no size is requested.
- Sample s of a blend comes from the member with the largest `w_k * max(s, 1) - drawn_k` (first on
  ties): deterministic, no RNG. Drawing more from a member than it holds is an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from meshforge.data.megatron.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetConfig,
    load_index_cache,
    split_document_indices,
)
from meshforge.data.megatron.indexed import IndexedDataset

MID_LEVEL_SURPLUS = 0.005


@dataclass(frozen=True)
class Blend:
    """A parsed blend list: prefixes and their (unnormalised) weights, or None for prefixes only."""

    prefixes: list[str]
    weights: list[float] | None


def _as_weight(value: str | float) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_blend(data_path: Sequence[str | float], key: str = "data_path") -> Blend:
    """Parse a Megatron blend list (see the module docstring).

    Raises:
        ValueError: empty list, a number after a non-number weight, or a non-positive weight; the
            message names `key[i]`.
    """
    items = list(data_path)
    if not items:
        raise ValueError(f"{key}: empty; give dataset prefixes, optionally preceded by weights")
    if len(items) % 2 == 1:
        return Blend([str(p).strip() for p in items], None)
    weights = [_as_weight(items[i]) for i in range(0, len(items), 2)]
    if any(w is None for w in weights):
        first = next(i for i, w in enumerate(weights) if w is None)
        later = [i for i, w in enumerate(weights) if i > first and w is not None]
        if later:
            bad = 2 * later[0]
            raise ValueError(
                f"{key}[{bad}]: {items[bad]!r} is a weight but {key}[{2 * first}] ({items[2 * first]!r}) is "
                "not a number; give 'weight, prefix' pairs with numeric weights, or prefixes only"
            )
        return Blend([str(p).strip() for p in items], None)
    numbers = [w for w in weights if w is not None]  # all of them: a None returned above
    for i, w in enumerate(numbers):
        if not w > 0 or math.isinf(w):
            raise ValueError(
                f"{key}[{2 * i}]: a blend weight must be a positive number, got {items[2 * i]!r}"
            )
    return Blend([str(items[i]).strip() for i in range(1, len(items), 2)], numbers)


def normalize(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def member_sizes(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples to take (surplus 0) or build (surplus 0.005) from each member for a blend of `size`."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(member of each blend sample as int16, its sample number within that member as int64)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    members = np.zeros(size, dtype=np.int16)
    numbers = np.zeros(size, dtype=np.int64)
    pick_list = [0] * size
    number_list = [0] * size
    ks = range(len(w))
    for s in range(size):
        scale = float(max(s, 1))
        best, best_err = 0, w[0] * scale - counts[0]
        for k in ks:
            err = w[k] * scale - counts[k]
            if err > best_err:
                best, best_err = k, err
        pick_list[s] = best
        number_list[s] = counts[best]
        counts[best] += 1
    members[:] = pick_list
    numbers[:] = number_list
    return members, numbers


def exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every member once, interleaved by the same error rule over unspent members."""
    total = int(sum(sizes))
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [k for k, n in enumerate(sizes) if n > 0]
    members = np.zeros(total, dtype=np.int16)
    numbers = np.zeros(total, dtype=np.int64)
    for s in range(total):
        scale = float(max(s, 1))
        best, best_err = -1, -math.inf
        for k in unspent:
            err = w[k] * scale - counts[k]
            if err > best_err:
                best, best_err = k, err
        members[s] = best
        numbers[s] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return members, numbers


class BlendedDataset:
    """Samples drawn from member datasets by weight (see the module docstring).

    Args:
        datasets: members (GPTDatasets of the same split).
        weights: one per member (normalised here when `size` is given).
        size: blend length; None = every sample of every member (weights are then member sizes).
        split: split name, for the cache file names.
        cache_dir: folder of the cached indices (None: not cached).
        prefixes: member names for error messages.
        rank, barrier, log: as for `GPTDataset`.
    """

    def __init__(
        self,
        datasets: Sequence[GPTDataset],
        weights: Sequence[float],
        size: int | None,
        *,
        split: str = "train",
        cache_dir: str | Path | None = None,
        prefixes: Sequence[str] | None = None,
        rank: int = 0,
        barrier: Callable[[], None] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise ValueError("at most 32766 datasets can be blended (int16 dataset index)")
        self.datasets = list(datasets)
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        self.split = split
        self.prefixes = list(prefixes) if prefixes is not None else [d.indexed.prefix for d in datasets]
        self.description = json.dumps(
            {
                "class": "BlendedDataset",
                "datasets": [d.description_hash for d in self.datasets],
                "split": split,
                "weights": self.weights,
                "size": size,
            },
            indent=4,
        )
        self.description_hash = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir, rank, barrier, log)

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        if self.size is not None:
            members, numbers = blending_indices(self.weights, self.size)
        else:
            # Without a size the weights are the member lengths, kept as ints by __init__.
            members, numbers = exhaustive_blending_indices(cast(list[int], self.weights))
        drawn = np.bincount(members, minlength=len(self.datasets))
        for k, (count, dataset) in enumerate(zip(drawn, self.datasets, strict=True)):
            if count > len(dataset):
                raise IndexError(
                    f"the {self.split} blend oversamples data_path member {k} ({self.prefixes[k]}, weight "
                    f"{self.weights[k]:.4g}): it needs {count} samples but that dataset was built with "
                    f"{len(dataset)}; lower this weight or give that dataset more data"
                )
        return members, numbers

    def _load_or_build(
        self,
        cache_dir: str | Path | None,
        rank: int,
        barrier: Callable[[], None] | None,
        log: Callable[[str], None] | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        if cache_dir is None:
            return self._build()
        folder = Path(cache_dir)
        base = f"{self.description_hash}-BlendedDataset-{self.split}"
        paths = {
            n: folder / f"{base}-{n}"
            for n in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")
        }
        if not all(p.is_file() for p in paths.values()) and rank == 0:
            start = time.perf_counter()
            arrays = self._build()
            folder.mkdir(parents=True, exist_ok=True)
            for name, array in zip(("dataset_index.npy", "dataset_sample_index.npy"), arrays, strict=True):
                tmp = paths[name].with_name(paths[name].name + f".tmp{os.getpid()}.npy")
                np.save(tmp, array, allow_pickle=False)
                os.replace(tmp, paths[name])
            tmp = paths["description.txt"].with_name(f"{base}-description.txt.tmp{os.getpid()}")
            tmp.write_text(self.description, encoding="utf-8")
            os.replace(tmp, paths["description.txt"])
            if log is not None:
                log(
                    f"BlendedDataset ({self.split}): built the index of {len(arrays[0]):,} samples over "
                    f"{len(self.datasets)} datasets in {time.perf_counter() - start:.2f}s"
                )
        if barrier is not None:
            barrier()
        if not all(p.is_file() for p in paths.values()):
            raise FileNotFoundError(
                f"BlendedDataset ({self.split}): rank 0 did not write {paths['description.txt']}; the cache "
                "folder must be shared by every rank, or set train_dataset.no_shared_storage: true to build "
                "a copy on every node"
            )
        return (
            load_index_cache(paths["dataset_index.npy"]),
            load_index_cache(paths["dataset_sample_index.npy"]),
        )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def sample(self, index: int) -> dict[str, object]:
        """`{"dataset_id": k, **member_k.sample(i)}` (Megatron's BlendedDataset item)."""
        k = int(self.dataset_index[index])
        return {"dataset_id": k, **self.datasets[k].sample(int(self.dataset_sample_index[index]))}

    def contract_sample(self, index: int) -> dict[str, np.ndarray]:
        k = int(self.dataset_index[index])
        return self.datasets[k].contract_sample(int(self.dataset_sample_index[index]))

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples `indices` stacked: the `SampleSource` interface of `meshforge.data.loader`."""
        rows = [self.contract_sample(int(i)) for i in np.asarray(indices).reshape(-1)]
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


def build_datasets(
    data_path: Sequence[str | float],
    split: str,
    sizes: Sequence[int | None],
    config: GPTDatasetConfig,
    *,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    key: str = "data_path",
    only: Sequence[int] = (0, 1, 2),
) -> list[GPTDataset | BlendedDataset | None]:
    """Megatron's BlendedMegatronDatasetBuilder for GPTDataset: one dataset per split, None where the
    split is 0.

    Args:
        data_path: the blend list (prefixes are resolved by the caller).
        split: e.g. '99,1,0'.
        sizes: samples wanted per split (train, valid, test); None = one epoch / exhaustive.
        config: GPTDataset settings.
        rank, barrier, log: see `GPTDataset`.
        key: config key path of `data_path`, for messages.
        only: the splits to build (0 train, 1 valid, 2 test); the others come back as None.

    Raises:
        ValueError / FileNotFoundError / IndexError: bad blend, missing files, unmeetable weights.
    """
    blend = parse_blend(data_path, key)
    sizes = list(sizes) + [None] * (3 - len(sizes))
    indexed = [IndexedDataset(prefix) for prefix in blend.prefixes]

    def member(k: int, split_no: int, num_samples: int | None) -> GPTDataset | None:
        docs = split_document_indices(len(indexed[k]), split)[split_no]
        if docs is None:
            return None
        return GPTDataset(
            indexed[k],
            docs,
            num_samples,
            config,
            split=SPLIT_NAMES[split_no],
            rank=rank,
            barrier=barrier,
            log=log,
        )

    def blend_member(k: int, split_no: int, num_samples: int | None) -> GPTDataset:
        dataset = member(k, split_no, num_samples)
        # Only a split of weight 0 has no documents, and the loop below skips those.
        assert dataset is not None
        return dataset

    result: list[GPTDataset | BlendedDataset | None] = []
    if len(blend.prefixes) == 1 and blend.weights is None:
        return [member(0, i, sizes[i]) if i in only else None for i in range(3)]
    weights = normalize(blend.weights) if blend.weights is not None else None
    for i in range(3):
        if i not in only or split_document_indices(1, split)[i] is None:
            result.append(None)
            continue
        wanted = sizes[i]
        if weights is not None:
            if wanted is None:
                raise ValueError(f"{key}: blend weights need a requested number of samples (sizes[{i}])")
            built = [
                blend_member(k, i, n) for k, n in enumerate(member_sizes(weights, wanted, MID_LEVEL_SURPLUS))
            ]
            size_i: int | None = sum(member_sizes(weights, wanted))
            blend_weights: Sequence[float] = weights
        else:
            built = [blend_member(k, i, None) for k in range(len(indexed))]
            lengths = [len(d) for d in built]
            blend_weights = lengths
            size_i = None if wanted is None else min(wanted, sum(lengths))
        cache = config.path_to_cache or str(Path(blend.prefixes[0]).parent / "cache" / "GPTDataset_indices")
        result.append(
            BlendedDataset(
                built,
                blend_weights,
                size_i,
                split=SPLIT_NAMES[i],
                cache_dir=cache,
                prefixes=blend.prefixes,
                rank=rank,
                barrier=barrier,
                log=log,
            )
        )
    return result
