"""The step watchdog: a rank that sleeps inside a step is named within the timeout, and the job exits.

Rank 1 sleeps in the forward of step 3 (`_hang_worker.py`); rank 0 has gone on into the step's
first collective. Both write their hang files, rank 0 prints the one line, and both exit 3.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import worker_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 3


def test_a_sleeping_rank_is_named_and_the_job_exits(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(Path(__file__).with_name("_hang_worker.py")), str(tiny_config), "--training.steps=6",
        f"--training.output_dir={out}", f"--training.step_timeout_s={TIMEOUT_S}",
    ]  # fmt: skip
    env = worker_env()
    env["PYTHONPATH"] = f"{Path(__file__).parents[2] / 'src'}:{env.get('PYTHONPATH', '')}"
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert re.search(r"exitcode\s*:\s*3\b", output), output  # torchrun's failure summary
    assert took < 60, took  # the sleep is 120 s: the watchdog ended the job
    lines = re.findall(r"^.*hang: step 3 ran .*$", output, flags=re.M)
    assert len(lines) == 1, output
    assert "rank(s) 1 had not arrived" in lines[0]
    assert "rank(s) 0 wait in all_gather_single over 2 ranks" in lines[0]  # FSDP2 gathers the weights
    assert f"stacks in {out}/hang-rank*.txt" in lines[0]
    rank0 = (out / "hang-rank0.txt").read_text()
    rank1 = (out / "hang-rank1.txt").read_text()
    assert rank0.startswith("rank 0 of 2: step 3 running for ")
    assert "collective in flight: all_gather_single over 2 ranks" in rank0
    assert "collective in flight: none" in rank1
    assert "in forward_backward" in rank1 and "_hang_worker.py" in rank1  # the sleeping frame
