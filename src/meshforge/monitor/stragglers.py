"""Stragglers: how far the slowest rank's step time is from the median, on log steps only.

A rank on a slow host, a throttled accelerator or a busy link slows every rank of a synchronous
job without failing. One all-gather of one float per rank on each log step (`training.log_interval`)
gives the spread: `step_time_median_s`, `step_time_max_s` and `slowest_rank` in the step record
(metrics.jsonl, the trackers), and the console line names the slowest rank when it is more than
20 % above the median.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

# Above this ratio of the slowest rank's step time to the median, the console line says so.
CONSOLE_RATIO = 1.2


def step_time_spread(
    seconds: float, group: dist.ProcessGroup | None = None, *, device: torch.device
) -> dict[str, float | int]:
    """Collective over `group` (every rank calls it on the same steps): the spread of one step's time."""
    world = dist.get_world_size(group)
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    times = [float(t.item()) for t in every]
    slowest = max(range(world), key=times.__getitem__)
    return {
        "step_time_median_s": statistics.median(times),
        "step_time_max_s": times[slowest],
        "slowest_rank": slowest,
    }


def straggler_note(record: dict[str, object]) -> str | None:
    """The console's words for a straggling rank, or None when the ranks keep pace."""
    median, slowest = record.get("step_time_median_s"), record.get("step_time_max_s")
    if not isinstance(median, float) or not isinstance(slowest, float) or median <= 0:
        return None
    if slowest / median <= CONSOLE_RATIO:
        return None
    return f"slowest rank {record['slowest_rank']} {slowest:.3g} s vs median {median:.3g} s"
