"""`profiler.export_type: db`: a profiling window as a SQLite database instead of a Chrome trace.

torch.profiler itself exports Chrome traces only (the `.db` of MindSpeed comes from Ascend's
msprof); the database here is written from the profiler's own event list with the standard
`sqlite3` module, so any SQL client (or pandas) can query a window without loading a trace:

- `meta(key, value)`: `rank`, `first_step`, `last_step`, `device_type`, `profiler_level`, `torch`;
- `events(id, parent_id, step, name, thread, device_type, start_us, duration_us, self_cpu_us,
  self_device_us, input_shapes, cpu_memory_bytes, device_memory_bytes, flops)`: one row per
  recorded range (operators, the `ProfilerStep#N` and phase ranges, Python frames with
  `with_stack`); `step` is the training step whose `ProfilerStep#N` range was open when it
  started (null before the first), `parent_id` the enclosing range, times in microseconds from the window's start;
- `operators(name, calls, self_cpu_us, cpu_total_us, self_device_us, device_total_us, flops)`:
  the per-name totals that the end-of-window summary line ranks;
- `meta.source`: the event list, or the Chrome trace when torch cannot read its event list back
  (then parent ids, self times and memory are null).

Example: `SELECT name, SUM(self_cpu_us) FROM events WHERE step = 3 GROUP BY name ORDER BY 2 DESC`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.profiler import profile

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE events (
    id INTEGER PRIMARY KEY, parent_id INTEGER, step INTEGER, name TEXT NOT NULL, thread INTEGER,
    device_type TEXT, start_us REAL, duration_us REAL, self_cpu_us REAL, self_device_us REAL,
    input_shapes TEXT, cpu_memory_bytes INTEGER, device_memory_bytes INTEGER, flops INTEGER
);
CREATE TABLE operators (
    name TEXT PRIMARY KEY, calls INTEGER, self_cpu_us REAL, cpu_total_us REAL,
    self_device_us REAL, device_total_us REAL, flops INTEGER
);
CREATE INDEX events_step ON events (step);
CREATE INDEX events_name ON events (name);
"""


def _is_step(event: Any) -> bool:
    # torch names the schedule's step ranges `ProfilerStep#N` in the trace but `ProfilerStep*` in
    # its event list (so that key_averages groups them).
    return str(event.name).startswith("ProfilerStep")


def _step_at(start: float, bounds: list[tuple[float, float, int]]) -> int | None:
    """The training step whose range was open at `start` (microseconds), if any."""
    k = bisect.bisect_right(bounds, (start, math.inf, 0)) - 1
    if k >= 0 and bounds[k][0] <= start <= bounds[k][1]:
        return bounds[k][2]
    return None


def export_sqlite(prof: profile, path: Path, meta: dict[str, object], *, first_step: int) -> int:
    """Write the window of `prof` (a finished `torch.profiler.profile` over the steps from
    `first_step` on) to `path`; return the number of events written.

    When torch cannot read its own event list back (Python frames of code freed inside the window
    under `with_stack`: pytorch#64345), the rows come from its Chrome trace instead, which torch
    writes without decoding them: no parent ids, self times or memory, `meta.source` says so.
    """
    try:
        rows, operators = _event_list_rows(prof, first_step)
        source = "torch.profiler event list"
    except UnicodeDecodeError:
        rows, operators = _chrome_trace_rows(prof, path.with_suffix(".trace.json"), first_step)
        source = "Chrome trace (torch could not read back its event list: profiler.with_stack)"
    path.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(SCHEMA)
        entries = [*meta.items(), ("source", source)]
        db.executemany("INSERT INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in entries])
        db.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 14)})", rows)
        db.executemany("INSERT OR REPLACE INTO operators VALUES (?, ?, ?, ?, ?, ?, ?)", operators)
        db.commit()
    return len(rows)


def _event_list_rows(prof: profile, first_step: int) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    events = list(prof.events())
    ids = {id(event): number for number, event in enumerate(events, start=1)}
    ranges = sorted((e for e in events if _is_step(e)), key=lambda e: e.time_range.start)
    steps = {id(event): first_step + k for k, event in enumerate(ranges)}
    # By time, not by parent: the phase ranges of a step do not list its step range as parent.
    bounds = [(e.time_range.start, e.time_range.end, steps[id(e)]) for e in ranges]
    rows = []
    for event in events:
        parent = event.cpu_parent
        step = _step_at(event.time_range.start, bounds)
        rows.append(
            (
                ids[id(event)],
                ids.get(id(parent)) if parent is not None else None,
                step,
                f"ProfilerStep#{steps[id(event)]}" if id(event) in steps else str(event.name),
                int(event.thread),
                str(event.device_type).rsplit(".", 1)[-1],
                float(event.time_range.start),
                float(event.time_range.elapsed_us()),
                float(event.self_cpu_time_total),
                float(event.self_device_time_total),
                json.dumps(event.input_shapes) if event.input_shapes else None,
                int(event.cpu_memory_usage),
                int(event.device_memory_usage),
                int(event.flops or 0),
            )
        )
    operators = [
        (
            str(avg.key),
            int(avg.count),
            float(avg.self_cpu_time_total),
            float(avg.cpu_time_total),
            float(avg.self_device_time_total),
            float(avg.device_time_total),
            int(avg.flops or 0),
        )
        for avg in prof.key_averages()
    ]
    return rows, operators


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def _chrome_trace_rows(
    prof: profile, trace: Path, first_step: int
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The rows of the database from the Chrome trace torch writes for `prof` (then removed)."""
    prof.export_chrome_trace(str(trace))
    try:
        data = json.loads(trace.read_bytes().decode("utf-8", errors="replace"))
    finally:
        trace.unlink(missing_ok=True)
    spans = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ranges = sorted(
        (e for e in spans if str(e.get("name", "")).startswith("ProfilerStep")), key=lambda e: e["ts"]
    )
    bounds = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), first_step + k) for k, e in enumerate(ranges)
    ]
    steps = {id(e): first_step + k for k, e in enumerate(ranges)}
    rows: list[tuple[Any, ...]] = []
    totals: dict[str, list[float]] = {}
    for number, event in enumerate(spans, start=1):
        args = event.get("args") or {}
        on_device = event.get("cat") in _DEVICE_CATEGORIES
        name = f"ProfilerStep#{steps[id(event)]}" if id(event) in steps else str(event.get("name", ""))
        start, duration, flops = float(event["ts"]), float(event["dur"]), int(args.get("flops") or 0)
        shapes = args.get("Input Dims")
        rows.append(
            (
                number,
                None,
                _step_at(start, bounds),
                name,
                event.get("tid") if isinstance(event.get("tid"), int) else None,
                "CUDA" if on_device else "CPU",
                start,
                duration,
                None,
                None,
                json.dumps(shapes) if shapes else None,
                None,
                None,
                flops,
            )
        )
        entry = totals.setdefault(name, [0, 0.0, 0.0, 0])
        entry[0] += 1
        entry[2 if on_device else 1] += duration
        entry[3] += flops
    operators = [(name, int(n), None, cpu, None, dev, int(f)) for name, (n, cpu, dev, f) in totals.items()]
    return rows, operators
