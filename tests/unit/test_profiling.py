"""The profiler window: a Chrome trace of exactly the listed steps, the summary line, and clear
errors for windows outside the run and ranks that do not exist (before the first step)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from meshforge.monitor.profiling import ProfilerConfig, StepProfiler
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)


def _build(tmp_path: Path, **fields: object) -> StepProfiler | None:
    cfg = ProfilerConfig(enable_profiling=True, **fields)  # type: ignore[arg-type]
    return StepProfiler.build(
        cfg,
        rank=1,
        world_size=2,
        start_step=2,
        total_steps=10,
        output_dir=tmp_path,
        device_type="cpu",
        log=print,
    )


def test_window_and_rank_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^profiler.end_step: 11 is past the run's last step \(10\)"):
        _build(tmp_path, start_step=3, end_step=11)
    with pytest.raises(ValueError, match=r"^profiler.start_step: 2 is not after the resumed step 2"):
        _build(tmp_path, start_step=2, end_step=4)
    with pytest.raises(
        ValueError, match=r"^profiler.profiler_rank: rank\(s\) \[2\] do not exist \(world size 2"
    ):
        _build(tmp_path, start_step=3, end_step=4, profiler_rank=[0, 2])
    assert _build(tmp_path, start_step=3, end_step=4, profiler_rank=[0]) is None  # not this rank
    window = _build(tmp_path, start_step=3, end_step=4, output_path=str(tmp_path / "elsewhere"))
    assert window is not None and window.trace == tmp_path / "elsewhere" / "rank1_step3-4.pt.trace.json.gz"
    cfg = ProfilerConfig(start_step=3, end_step=4)
    assert (
        StepProfiler.build(
            cfg,
            rank=0,
            world_size=1,
            start_step=0,
            total_steps=2,
            output_dir=tmp_path,
            device_type="cpu",
            log=print,
        )
        is None
    )  # off: nothing checked


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_profiled_run_writes_one_trace_of_its_window(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    out = tiny_config.parent / "prof"
    overrides = [
        "training.steps=4",
        f"training.output_dir={out}",
        "checkpoint.enable_save=false",
        "profiler.enable_profiling=true",
        "profiler.start_step=2",
        "profiler.end_step=3",
        "profiler.profiler_level=1",
    ]
    lines: list[str] = []
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lines.append)
    trainer.setup()
    trainer.train()
    traces = sorted((out / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0_step2-3.pt.trace.json.gz"]
    trace = json.loads(gzip.decompress(traces[0].read_bytes()))
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
    assert {"forward_backward", "clip_grads", "optimizer"} <= names
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert len(steps) == 2  # the two steps of the window, nothing before or after
    # Level 1 records input shapes.
    assert any("Input Dims" in event.get("args", {}) for event in trace["traceEvents"])
    summary = [line for line in lines if line.startswith("profiler: steps 2-3 on rank 0 -> ")]
    assert len(summary) == 1 and "top operators by self time: aten::" in summary[0]


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_window_past_the_run_fails_before_the_first_step(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(tiny_config),
        [
            "training.steps=4",
            f"training.output_dir={tiny_config.parent / 'late'}",
            "profiler.enable_profiling=true",
            "profiler.start_step=3",
            "profiler.end_step=9",
        ],
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    with pytest.raises(ValueError, match="profiler.end_step: 9 is past the run's last step"):
        trainer.setup()
    assert trainer.step == 0


def test_profiler_keys_without_the_profiler_are_warned() -> None:
    from meshforge.config.loader import config_from_dict
    from meshforge.config.noops import noop_notes
    from meshforge.config.unsupported import unsupported_features

    cfg = config_from_dict({"profiler": {"start_step": 2, "end_step": 3, "mstx": True}})
    notes = dict(noop_notes(cfg, "cpu"))
    assert notes["profiler.start_step"] == "no effect without profiler.enable_profiling: true"
    assert "profiler.end_step" in notes and "NVTX" in notes["profiler.mstx"]
    assert "profiler.mstx" not in dict(noop_notes(cfg, "cuda"))
    on = config_from_dict({"profiler": {"enable_profiling": True, "start_step": 2, "end_step": 3}})
    assert not [path for path, _ in noop_notes(on, "cpu") if path.startswith("profiler.")]
    db = config_from_dict({"profiler": {"enable_profiling": True, "export_type": "db"}})
    assert unsupported_features(db) == []  # written as SQLite (test_a_db_window_is_a_sqlite_database)
    assert "profiler.export_type" in dict(
        noop_notes(config_from_dict({"profiler": {"export_type": "db"}}), "cpu")
    )


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_db_window_is_a_sqlite_database_of_its_steps(tiny_config: Path) -> None:
    import sqlite3

    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    out = tiny_config.parent / "prof-db"
    overrides = [
        "training.steps=2",
        f"training.output_dir={out}",
        "checkpoint.enable_save=false",
        "profiler.enable_profiling=true",
        "profiler.start_step=1",
        "profiler.end_step=2",
        "profiler.export_type=db",
        "profiler.with_stack=false",  # Python frames would be most of the rows and of the time
    ]
    lines: list[str] = []
    trainer = Trainer(load_config(str(tiny_config), overrides), log=lines.append)
    trainer.setup()
    trainer.train()
    files = sorted((out / "profile").iterdir())
    assert [p.name for p in files] == ["rank0_step1-2.db"]  # instead of the Chrome trace
    db = sqlite3.connect(files[0])
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        assert (meta["rank"], meta["first_step"], meta["last_step"]) == ("0", "1", "2")
        steps = [row[0] for row in db.execute("SELECT DISTINCT step FROM events WHERE step IS NOT NULL")]
        assert sorted(steps) == [1, 2]
        step_ranges = [
            row[0] for row in db.execute("SELECT name FROM events WHERE name LIKE 'ProfilerStep#%'")
        ]
        assert sorted(step_ranges) == ["ProfilerStep#1", "ProfilerStep#2"]
        phases = {row[0] for row in db.execute("SELECT name FROM events WHERE step = 2")}
        assert {"forward_backward", "clip_grads", "optimizer"} <= phases
        # Every operator sits inside a step and under a parent range; the totals agree with the events.
        (mm_calls,) = db.execute("SELECT COUNT(*) FROM events WHERE name = 'aten::mm'").fetchone()
        (mm_total,) = db.execute("SELECT calls FROM operators WHERE name = 'aten::mm'").fetchone()
        assert mm_calls > 0 and mm_total == mm_calls
        (orphans,) = db.execute(
            "SELECT COUNT(*) FROM events WHERE name LIKE 'aten::%' AND (step IS NULL OR parent_id IS NULL)"
        ).fetchone()
        assert orphans == 0
    finally:
        db.close()
    summary = [line for line in lines if line.startswith("profiler: steps 1-2 on rank 0 -> ")]
    assert len(summary) == 1 and summary[0].split(" -> ")[1].startswith(str(files[0]))


def test_a_db_window_falls_back_to_the_chrome_trace_when_torch_cannot_read_its_events(tmp_path: Path) -> None:
    """torch's event list can fail to decode Python frame names (with_stack, pytorch#64345)."""
    import sqlite3

    import torch

    from meshforge.monitor.profiling_db import export_sqlite

    with torch.profiler.profile() as prof:
        for i in range(2):  # the ranges a schedule opens per step, named as torch names them
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                a = torch.randn(16, 16)
                torch.mm(a, a)

    class Unreadable:
        """The finished profile, except that its event list cannot be decoded."""

        def events(self) -> list:
            raise UnicodeDecodeError("utf-8", b"\x94", 0, 1, "invalid start byte")

        def key_averages(self) -> list:
            raise AssertionError("not reached")

        def export_chrome_trace(self, path: str) -> None:
            prof.export_chrome_trace(path)

    db_path = tmp_path / "rank0_step3-4.db"
    written = export_sqlite(Unreadable(), db_path, {"rank": 0}, first_step=3)
    assert written > 0 and sorted(p.name for p in tmp_path.iterdir()) == [db_path.name]  # trace removed
    db = sqlite3.connect(db_path)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        assert meta["source"].startswith("Chrome trace")
        ranges = sorted(r[0] for r in db.execute("SELECT name FROM events WHERE name LIKE 'ProfilerStep#%'"))
        assert ranges == ["ProfilerStep#3", "ProfilerStep#4"]
        mm_steps = [
            r[0] for r in db.execute("SELECT step FROM events WHERE name = 'aten::mm' ORDER BY start_us")
        ]
        assert mm_steps == [3, 4]
        (calls,) = db.execute("SELECT calls FROM operators WHERE name = 'aten::mm'").fetchone()
        assert calls == 2
    finally:
        db.close()
