"""The part of `datasets`' `Dataset` and `IterableDataset` that the SFT pipeline calls.

`datasets` ships no type hints (no `py.typed`), so its objects reach mypy untyped. These protocols
name the methods meshforge uses, with the arguments it passes, so that mypy checks those calls;
every `datasets` object the pipeline holds is annotated with one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

EncodedRow = dict[str, list[int]]
"""One encoded row as the encoders write it: input_ids, labels (and position/segment ids when packed)."""


class ArrowDataset(Protocol):
    """A map-style `datasets.Dataset` (columns of records held in Arrow tables)."""

    @property
    def column_names(self) -> list[str]: ...

    def __len__(self) -> int: ...

    def __getitem__(self, column: str, /) -> Sequence[object]: ...

    def select(self, indices: Iterable[int], /) -> ArrowDataset: ...

    def map(
        self,
        function: Callable[..., Mapping[str, list[object]]],
        *,
        batched: bool,
        batch_size: int,
        num_proc: int | None,
        remove_columns: list[str],
        load_from_cache_file: bool,
        fn_kwargs: Mapping[str, object],
        desc: str,
    ) -> ArrowDataset: ...

    def train_test_split(self, *, test_size: float | int, seed: int) -> Mapping[str, ArrowDataset]: ...


class ArrowStream(Protocol):
    """A `datasets.IterableDataset` of records (dicts of column values)."""

    def shuffle(self, *, seed: int, buffer_size: int) -> ArrowStream: ...

    def set_epoch(self, epoch: int, /) -> None: ...

    def filter(
        self, function: Callable[[dict[str, list[object]]], list[bool]], *, batched: bool
    ) -> ArrowStream: ...

    def map(
        self,
        function: Callable[..., Mapping[str, list[object]]],
        *,
        batched: bool,
        batch_size: int,
        remove_columns: list[str],
        fn_kwargs: Mapping[str, object],
    ) -> ArrowStream: ...

    def take(self, n: int, /) -> ArrowStream: ...

    def __iter__(self) -> Iterator[dict[str, object]]: ...
