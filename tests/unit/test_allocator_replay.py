"""The caching allocator's placement replayed: rounding, pools, best fit, splits, merges, holes.

Each case is small enough to work out by hand from the allocator's rules (train/
allocator_replay.py's docstring); the last runs a real dry run and checks the reserved bytes
it reports are at least its live-bytes peak.
"""

from __future__ import annotations

import pytest

from meshforge.train.allocator_replay import LARGE_PAGE, SMALL_PAGE, AllocatorReplay

MIB = 1 << 20


def test_requests_round_to_512_bytes_and_pools_map_whole_pages() -> None:
    replay = AllocatorReplay()
    replay.allocate("a", 1)
    replay.allocate("b", 1000)
    assert replay.allocated_peak == 512 + 1024
    assert replay.reserved_peak == SMALL_PAGE  # both in the small pool's first page
    replay.allocate("c", 3 * MIB)
    assert replay.reserved_peak == SMALL_PAGE + LARGE_PAGE


def test_a_freed_block_is_reused_best_fit_and_split() -> None:
    replay = AllocatorReplay()
    for key, size in (("a", 30), ("b", 2), ("c", 10), ("d", 2)):
        replay.allocate(key, size * MIB)
    replay.free("a")
    replay.free("c")
    # 8 MiB fits both holes: best fit takes the 10 MiB one (at 32 MiB), whose 2 MiB rest is
    # over 1 MiB and so becomes its own free block.
    replay.allocate("e", 8 * MIB)
    pool = replay.large
    assert replay.live["e"][1] == 32 * MIB
    assert pool.sizes[40 * MIB] == 2 * MIB and 40 * MIB in pool.free_starts
    # A 20 MiB request takes the 30 MiB hole at the bottom: nothing new is mapped.
    mapped = pool.mapped
    replay.allocate("f", 20 * MIB)
    assert replay.live["f"][1] == 0 and pool.mapped == mapped


def test_neighbouring_free_blocks_merge() -> None:
    replay = AllocatorReplay()
    for key in "abc":
        replay.allocate(key, 4 * MIB)
    replay.allocate("guard", 4 * MIB)
    replay.free("a")
    replay.free("c")
    replay.free("b")  # merges with both neighbours: one 12 MiB block at 0
    assert replay.large.free == [(12 * MIB, 0)]
    replay.allocate("d", 12 * MIB)
    assert replay.live["d"][1] == 0


def test_holes_too_small_for_a_request_make_the_reserved_bytes_exceed_the_live_peak() -> None:
    """Fragmentation: 60 MiB live at most, but the 40 MiB request fits no hole."""
    replay = AllocatorReplay()
    for i in range(6):
        replay.allocate(i, 10 * MIB)
    for i in range(0, 6, 2):
        replay.free(i)  # three 10 MiB holes between live blocks
    replay.allocate("big", 40 * MIB)
    assert replay.allocated_peak == 70 * MIB
    assert replay.large.top == 100 * MIB and replay.reserved_peak == 100 * MIB


def test_a_free_block_at_the_end_grows_instead_of_leaving_a_hole() -> None:
    replay = AllocatorReplay()
    replay.allocate("a", 10 * MIB)
    replay.allocate("b", 10 * MIB)
    replay.free("b")
    replay.allocate("c", 25 * MIB)  # starts where b was, the range grows by 15 MiB
    assert replay.live["c"][1] == 10 * MIB and replay.large.top == 35 * MIB
    assert replay.reserved_peak == 2 * LARGE_PAGE


def test_a_resize_frees_the_old_block_and_places_the_new_size() -> None:
    replay = AllocatorReplay()
    replay.allocate("w", 8 * MIB)
    replay.allocate("w", 0)  # FSDP frees an unsharded parameter's storage by resizing it to 0
    assert replay.allocated == 0 and "w" not in replay.live
    replay.allocate("w", 8 * MIB)
    assert replay.allocated == 8 * MIB and replay.live["w"][1] == 0


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
def test_freeing_everything_leaves_one_free_block(order: list[int]) -> None:
    replay = AllocatorReplay()
    for i in range(3):
        replay.allocate(i, (i + 2) * MIB)
    for i in order:
        replay.free(i)
    assert replay.allocated == 0
    assert replay.large.free == [(9 * MIB, 0)] and len(replay.large.sizes) == 1


def test_expandable_segments_are_turned_on_unless_the_allocator_is_configured() -> None:
    from meshforge.utils.device import prefer_expandable_segments, resolve_device

    env: dict[str, str] = {}
    assert prefer_expandable_segments(env) and env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:128"}
        assert not prefer_expandable_segments(mine) and mine == {name: "max_split_size_mb:128"}
    # A CPU run leaves the environment alone.
    import os

    before = dict(os.environ)
    assert resolve_device("cpu").type == "cpu" and dict(os.environ) == before


def test_allocations_inside_a_stream_block_go_to_that_streams_pools() -> None:
    import torch

    from meshforge.train.allocator_replay import streams_routed

    replay = AllocatorReplay()
    side, default = torch.cpu.Stream(), torch.cpu.current_stream()
    with streams_routed(replay, torch.cpu):
        replay.allocate("compute", 4 * MIB)
        with torch.cpu.stream(side):
            replay.allocate("reduced", 4 * MIB)
            with torch.cpu.stream(default):
                replay.allocate("back", 4 * MIB)
        replay.free("compute")
        replay.allocate("again", 4 * MIB)  # reuses the default stream's freed block
    assert replay.stream is None and torch.cpu.stream is not None
    assert replay.live["reduced"][0] is replay.pool(side, False)
    assert replay.live["back"][0] is replay.large and replay.live["again"][1] == 0
    assert replay.reserved_peak == 2 * LARGE_PAGE  # one page in each stream's large pool


def test_a_full_device_releases_cached_pages_and_retries() -> None:
    """Capacity 60 MiB: A's freed pages are unmapped to make room for C (one retry)."""
    replay = AllocatorReplay(capacity=3 * LARGE_PAGE)
    replay.allocate("a", 30 * MIB)  # pages 0-1
    replay.allocate("b", 5 * MIB)  # page 1
    replay.free("a")
    replay.allocate("c", 35 * MIB)  # no hole holds it: 35-70 MiB, pages 1-3 (page 0 cached: 80 MiB)
    assert replay.retries == 1 and replay.out_of_memory_at is None
    assert replay.reserved == replay.reserved_peak == 3 * LARGE_PAGE
    # Without a capacity the cached page stays mapped.
    free = AllocatorReplay()
    for key, size in (("a", 30), ("b", 5)):
        free.allocate(key, size * MIB)
    free.free("a")
    free.allocate("c", 35 * MIB)
    assert free.reserved_peak == 4 * LARGE_PAGE and free.retries == 0


def test_pages_in_use_beyond_the_capacity_are_out_of_memory() -> None:
    replay = AllocatorReplay(capacity=2 * LARGE_PAGE)
    replay.allocate("a", 30 * MIB)
    assert replay.out_of_memory_at is None
    replay.allocate("b", 20 * MIB)  # 50 MiB in use: three pages
    assert replay.out_of_memory_at == 50 * MIB


@pytest.mark.parametrize(
    ("retries", "out_of_memory_at", "words"),
    [
        (0, None, "fits (2.00 GiB to spare)"),
        (3, None, "fits once the allocator releases its cached pages (3 retries"),
        (1, 9 << 30, "OUT OF MEMORY, 9.00 GiB in use"),
    ],
)
def test_the_dry_run_report_says_whether_the_step_fits_the_device(
    retries: int, out_of_memory_at: int | None, words: str
) -> None:
    from meshforge.train.dry_run import DryRunReport

    report = DryRunReport(
        rank=0,
        world_size=8,
        device="h100",
        device_type="cpu",
        seconds=1.0,
        peak_bytes=6 << 30,
        collectives=[],
        save_plan_items=1,
        reserved_bytes=8 << 30,
        capacity=10 << 30,
        retries=retries,
        out_of_memory_at=out_of_memory_at,
    )
    line = next(line for line in report.lines() if line.startswith("  on h100: 10.0 GiB for the allocator"))
    assert words in line, line
