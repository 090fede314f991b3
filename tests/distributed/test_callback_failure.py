"""A callback that raises on one rank of two: both stop at that step, the failing rank names the
callback and the error, rank 0 says which rank failed; no hang, no traceback of ours."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import meshforge_cmd, read_metrics, worker_env

pytestmark = pytest.mark.slow

FAILING = textwrap.dedent(
    """
    from meshforge.train.callbacks import Callback


    class FailOnRank1(Callback):
        def on_train_start(self, info):
            self.rank = info.rank

        def on_step_end(self, record):
            if self.rank == 1 and record["step"] == 2:
                raise ValueError("broken on purpose")
    """
)


def test_a_failing_callback_on_one_rank_stops_both_with_its_name(tiny_config: Path, tmp_path: Path) -> None:
    (tmp_path / "failing_cb.py").write_text(FAILING)
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *meshforge_cmd(nproc=2),
            "train",
            "--config",
            str(tiny_config),
            "--training.steps=6",
            f"--training.output_dir={out}",
            "--callbacks=[{type: 'failing_cb:FailOnRank1'}]",
        ],  # fmt: skip
        cwd=tmp_path,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    # Both ranks write to the same pipe: their lines can interleave, so look for each message.
    assert proc.stderr.count("error: ") == 2, proc.stderr
    assert "error: a callback failed on rank 1; the run stopped" in proc.stderr
    own = (
        "error: callbacks[0] (failing_cb:FailOnRank1): on_step_end raised ValueError: broken on purpose (at "
    )
    assert own in proc.stderr, proc.stderr
    assert "failing_cb.py:" in proc.stderr.split(own, 1)[1].split(")", 1)[0]
    assert proc.stderr.count("exitcode  : 1 ") == 2, proc.stderr
    assert "meshforge/train/" not in proc.stderr and "meshforge/callback" not in proc.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
