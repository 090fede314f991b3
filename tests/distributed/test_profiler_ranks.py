"""profiler_rank: on 2 processes only the listed rank writes a trace, of the listed steps only."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.slow


def test_only_the_listed_rank_profiles_its_window(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_train(
        tiny_config,
        [
            "--training.steps=4",
            f"--training.output_dir={out}",
            "--checkpoint.enable_save=false",
            "--profiler.enable_profiling=true",
            "--profiler.start_step=2",
            "--profiler.end_step=3",
            "--profiler.profiler_rank=[1]",
            f"--profiler.output_path={tmp_path / 'traces'}",
        ],
        nproc=2,
        cwd=tmp_path,
    )
    traces = sorted((tmp_path / "traces").iterdir())
    assert [p.name for p in traces] == ["rank1_step2-3.pt.trace.json.gz"]
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)
    assert len([n for n in names if n.startswith("ProfilerStep#")]) == 2
    assert not (out / "profile").exists()
    assert "[rank1] profiler: steps 2-3 on rank 1 -> " in proc.stderr
