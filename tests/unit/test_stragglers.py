"""The console names a straggling rank only when it is more than 20 % slower than the median."""

from __future__ import annotations

from meshforge.monitor.metrics import format_step_line

BASE = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0}


def test_a_straggler_is_named_on_the_console_line() -> None:
    even = {**BASE, "step_time_median_s": 1.0, "step_time_max_s": 1.1, "slowest_rank": 2}
    assert "slowest rank" not in format_step_line(even, 10)
    slow = {**BASE, "step_time_median_s": 1.0, "step_time_max_s": 1.5, "slowest_rank": 2}
    assert format_step_line(slow, 10).endswith("| slowest rank 2 1.5 s vs median 1 s")
    assert "slowest rank" not in format_step_line(BASE, 10)  # one process: no spread
