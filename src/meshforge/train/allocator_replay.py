"""The caching allocator's reserved memory, replayed from a dry run's allocations and frees.

Why: a device runs out of memory at its *reserved* bytes (what the caching allocator has mapped),
not at the bytes its live tensors hold. The two differ by fragmentation: a freed block between
live ones serves only requests that fit in it, so a step whose tensors change size (a layer's
activations, the loss's logits, FSDP's gathered weights) leaves holes and maps more than its
high-water mark of live bytes. The dry run sees every allocation and free of one step in order;
this replays them through the allocator's placement rules and reports what it would reserve.

Modelled: PyTorch's CUDA caching allocator with expandable segments
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which meshforge's launcher sets unless the
user set the variable): requests rounded up to 512 bytes; requests of at most 1 MiB served from
a small pool mapped in 2 MiB pages, larger ones from a large pool mapped in 20 MiB pages; each
pool one growing address range, served best fit (the smallest free block that holds the
request, split when the rest is worth keeping: 512 bytes in the small pool, over 1 MiB in the
large), freed blocks merged with free neighbours, a request no free block holds placed at the
end of the range (reusing a free block that ends it) and the range mapped further. Mapped pages
stay reserved until the cache is emptied, or until a mapping would pass the device's capacity:
then the pages no block in use touches are unmapped and the mapping retried (an out-of-memory
error when that is not enough). Each stream has its own pools, as a block freed on one
stream serves only that stream: `streams_routed` sends what FSDP2 allocates inside its
all-gather and reduce-scatter stream blocks (the gathered buffers, the reduced gradients that
become the sharded `.grad`) to their streams' pools.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # requests up to this size come from the small pool
SMALL_PAGE = 2 << 20
LARGE_PAGE = 20 << 20


def _round_up(size: int, unit: int) -> int:
    return -(-size // unit) * unit


@dataclass
class _Pool:
    """One expandable segment: blocks in one address range, mapped in whole pages."""

    page: int
    split_rest: int  # the smallest remainder a split leaves as its own free block
    top: int = 0  # the end of the last block
    pages: set[int] = field(default_factory=set)  # mapped pages (kept until the cache is released)
    mapped_peak: int = 0
    live: int = 0  # bytes of the blocks in use
    live_peak: int = 0
    sizes: dict[int, int] = field(default_factory=dict)  # start -> size of every block
    ends: dict[int, int] = field(default_factory=dict)  # end -> start of every block
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (size, start) of free blocks
    free_starts: set[int] = field(default_factory=set)

    @property
    def mapped(self) -> int:
        """Bytes of the pages mapped now."""
        return len(self.pages) * self.page

    def allocate(self, size: int) -> tuple[int, int]:
        """Place a block of `size` bytes: its start and the bytes of pages newly mapped for it."""
        self.live += size
        self.live_peak = max(self.live_peak, self.live)
        at = bisect.bisect_left(self.free, (size, -1))
        if at < len(self.free):
            block_size, start = self.free.pop(at)
            self.free_starts.discard(start)
            if block_size - size >= self.split_rest:
                self._set(start, size)
                self._set(start + size, block_size - size)
                self._mark_free(start + size)
            return start, self._map(start, size)
        last = self.ends.get(self.top)
        start = last if last is not None and last in self.free_starts else self.top
        if start != self.top:
            self._unmark_free(start)
            self._forget(start)
        self._set(start, size)
        self.top = start + size
        return start, self._map(start, size)

    def _map(self, start: int, size: int) -> int:
        before = len(self.pages)
        self.pages.update(range(start // self.page, _round_up(start + size, self.page) // self.page))
        return (len(self.pages) - before) * self.page

    def release_cached(self) -> int:
        """Unmap every page no block in use touches (what the allocator does when the device is
        full, before it retries); the bytes unmapped."""
        before = len(self.pages)
        kept: set[int] = set()
        for start, size in self.sizes.items():
            if start not in self.free_starts:
                kept.update(range(start // self.page, _round_up(start + size, self.page) // self.page))
        self.pages = kept
        return (before - len(kept)) * self.page

    def release(self, start: int) -> None:
        size = self.sizes[start]
        self.live -= size
        before = self.ends.get(start)
        if before is not None and before in self.free_starts:
            self._unmark_free(before)
            size += self.sizes[before]
            self._forget(before)
            self._forget(start)
            start = before
        else:
            self._forget(start)
        after = start + size
        if after in self.free_starts:
            self._unmark_free(after)
            size += self.sizes[after]
            self._forget(after)
        self._set(start, size)
        self._mark_free(start)

    def _set(self, start: int, size: int) -> None:
        self.sizes[start] = size
        self.ends[start + size] = start

    def _forget(self, start: int) -> None:
        size = self.sizes.pop(start)
        self.ends.pop(start + size, None)

    def _mark_free(self, start: int) -> None:
        bisect.insort(self.free, (self.sizes[start], start))
        self.free_starts.add(start)

    def _unmark_free(self, start: int) -> None:
        self.free.remove((self.sizes[start], start))
        self.free_starts.discard(start)


class AllocatorReplay:
    """Feed it every allocation and free of a step, in order; `reserved_peak` is what the caching
    allocator would have mapped, `allocated_peak` the live bytes' high-water mark (both rounded as
    the allocator rounds requests).

    With `capacity` (the bytes the allocator may map on the device), a mapping beyond it releases
    the cached pages first, as the allocator does before it retries (`retries` counts them: each
    synchronises the device); when the pages in use alone exceed it, the step runs out of memory
    (`out_of_memory_at`: the bytes in use then).
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.stream: object = None  # the stream allocations go to now (None: the default one)
        self.pools: dict[tuple[object, bool], _Pool] = {}
        self.live: dict[object, tuple[_Pool, int, int]] = {}
        self.allocated = 0
        self.allocated_peak = 0
        self.capacity = capacity
        self.reserved = 0
        self.reserved_peak = 0
        self.retries = 0
        self.out_of_memory_at: int | None = None

    def pool(self, stream: object, small: bool) -> _Pool:
        """The small or large pool of `stream` (made on first use)."""
        key = (stream, small)
        if key not in self.pools:
            self.pools[key] = (
                _Pool(page=SMALL_PAGE, split_rest=MIN_BLOCK)
                if small
                else _Pool(page=LARGE_PAGE, split_rest=SMALL_REQUEST + 1)
            )
        return self.pools[key]

    @property
    def small(self) -> _Pool:
        """The default stream's small pool."""
        return self.pool(None, True)

    @property
    def large(self) -> _Pool:
        """The default stream's large pool."""
        return self.pool(None, False)

    def allocate(self, key: object, nbytes: int) -> None:
        """A new block for `key` (a storage's identity), or a resize of its block."""
        if key in self.live:
            self.free(key)
        if nbytes <= 0:
            return
        size = _round_up(nbytes, MIN_BLOCK)
        pool = self.pool(self.stream, size <= SMALL_REQUEST)
        start, mapped = pool.allocate(size)
        self.live[key] = (pool, start, size)
        self.allocated += size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.reserved += mapped
        if self.capacity is not None and mapped and self.reserved > self.capacity:
            self.retries += 1
            self.reserved -= sum(p.release_cached() for p in self.pools.values())
            if self.reserved > self.capacity and self.out_of_memory_at is None:
                self.out_of_memory_at = self.allocated
        pool.mapped_peak = max(pool.mapped_peak, pool.mapped)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, key: object) -> None:
        found = self.live.pop(key, None)
        if found is None:
            return
        pool, start, size = found
        pool.release(start)
        self.allocated -= size

    def split(self) -> tuple[int, int, int]:
        """(the default stream's mapped bytes, its live high-water mark, the other streams'
        mapped bytes): fragmentation of the compute stream and the collective streams' caches."""
        default = [pool for (stream, _), pool in self.pools.items() if stream is None]
        side = sum(pool.mapped_peak for (stream, _), pool in self.pools.items() if stream is not None)
        return sum(p.mapped_peak for p in default), sum(p.live_peak for p in default), side


_STREAM = "stream"  # the device module's stream-context function


@contextlib.contextmanager
def streams_routed(replay: AllocatorReplay, device_module: ModuleType) -> Iterator[None]:
    """Within the block, allocations made inside `device_module.stream(s)` (FSDP2's collective
    streams; `torch.cpu` or `torch.cuda`) go to the pools of `s`; the current stream's own
    object counts as the default stream."""
    original = getattr(device_module, _STREAM)
    default = device_module.current_stream()

    @contextlib.contextmanager
    def routed(stream: object) -> Iterator[None]:
        before = replay.stream
        replay.stream = None if stream is None or stream == default else stream
        try:
            with original(stream):
                yield
        finally:
            replay.stream = before

    setattr(device_module, _STREAM, routed)
    try:
        yield
    finally:
        setattr(device_module, _STREAM, original)
