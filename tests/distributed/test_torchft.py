"""torchft replica groups on gloo: a group SIGKILLed mid-run, restarted, and re-admitted with equal weights.

Two replica groups train against a lighthouse in this process. Group 1 is killed once it has
logged a few steps and started again (a fresh job, no checkpoint); group 0 must keep stepping
through the failure, and group 1 must continue at group 0's step with group 0's weights. The
steps before the kill, with both groups in the quorum, must have the losses of one job over the
same global batch (each group reads half of it and the gradients are summed over the groups),
including step 2, whose loss group 0 makes NaN once: `training.rerun_mode` recomputes it on both
groups together and the recomputed result stands.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests._compare import rel_error
from tests.conftest import read_metrics, train_here, worker_env
from tests.distributed._ft_worker import PacedTrainer

torchft = pytest.importorskip("torchft")

pytestmark = [
    pytest.mark.slow,
    # torchft's own logger calls the deprecated Logger.warn.
    pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning"),
]

STEPS = 30
PACE_S = 0.5  # a step without the peer takes at least this long: the survivor outlives the restart
KILL_AFTER = 3  # records of group 1 before it is killed
WORKER = Path(__file__).with_name("_ft_worker.py")


class _Survivor(PacedTrainer):
    pace_s = PACE_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def _overrides(out: Path, group: int, lighthouse: str, nproc: int) -> list[str]:
    return [
        f"--training.steps={STEPS}",
        f"--training.global_batch_size={4 * nproc}",
        f"--training.output_dir={out}",
        "--checkpoint.enable_save=false",
        "--parallelism.fault_tolerance.enable=true",
        f"--parallelism.fault_tolerance.replica_id={group}",
        f"--parallelism.fault_tolerance.lighthouse={lighthouse}",
        "--parallelism.fault_tolerance.quorum_timeout_s=60",
        "--monitor.plot_curves=false",
    ]


def _launch(
    config: Path, overrides: list[str], nproc: int, log: Path, go: str = "-"
) -> list[subprocess.Popen[bytes]]:
    """One replica group: `nproc` ranks started directly (torchrun's environment, without its agent)."""
    cmd = [sys.executable, str(WORKER), str(PACE_S), go, str(config), *overrides]
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        env = worker_env()
        if nproc > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc))
            env.update(MASTER_ADDR="localhost", MASTER_PORT=port)
        with log.with_suffix(f".rank{rank}.log").open("w") as sink:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=log.parent)
            )
    return procs


def _kill_when_due(doomed: list[subprocess.Popen[bytes]], out: Path, go: Path) -> None:
    """SIGKILL every rank of a group once it has logged KILL_AFTER steps, then let its stand-by go."""
    deadline = time.monotonic() + 120
    while _records(out) < KILL_AFTER and doomed[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # The whole group dies at once (a lost node).
    for proc in doomed:
        proc.kill()
    for proc in doomed:
        proc.wait(timeout=60)
    go.touch()


def _log(log: Path) -> str:
    return "".join(path.read_text()[-4000:] for path in sorted(log.parent.glob(f"{log.stem}.rank*.log")))


def _records(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait(procs: list[subprocess.Popen[bytes]], log: Path, timeout: float = 120) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs), _log(log)


def _params(out: Path, nproc: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"params-rank{r}.pt", weights_only=True) for r in range(nproc)]


@pytest.mark.parametrize("nproc", [1, 2])
def test_group_killed_and_restarted_rejoins_with_the_survivors_weights(
    tiny_config: Path, tmp_path: Path, nproc: int
) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )
    survivor, killed, restarted = (tmp_path / name for name in ("g0", "g1", "g1-restarted"))
    logs = [tmp_path / f"{name}.log" for name in ("g0", "g1", "g1-restarted")]
    address = lighthouse.address()
    go = tmp_path / "go"
    doomed: list[subprocess.Popen[bytes]] = []
    again: list[subprocess.Popen[bytes]] = []
    first: list[subprocess.Popen[bytes]] = []
    try:
        doomed = _launch(tiny_config, _overrides(killed, 1, address, nproc), nproc, logs[1])
        # The replacement starts now and waits, imports done, for the go file: the test then
        # measures the recovery, not an interpreter's start-up.
        again = _launch(tiny_config, _overrides(restarted, 1, address, nproc), nproc, logs[2], go=str(go))
        killer = threading.Thread(target=_kill_when_due, args=(doomed, killed, go), daemon=True)
        killer.start()
        if nproc == 1:
            # A one-process survivor trains in this process: one interpreter fewer to start.
            train_here(tiny_config, _overrides(survivor, 0, address, nproc), trainer_cls=_Survivor)
        else:
            first = _launch(tiny_config, _overrides(survivor, 0, address, nproc), nproc, logs[0])
            _wait(first, logs[0])
        killer.join(timeout=120)
        assert _records(killed) >= KILL_AFTER, _log(logs[1])
        _wait(again, logs[2])
    finally:
        for proc in [*doomed, *first, *again]:
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()

    alive, rejoined, before = read_metrics(survivor), read_metrics(restarted), read_metrics(killed)
    # The survivor never stopped: every step is logged, it trained alone for a while, and most
    # steps committed (only a step the peer died inside may not).
    assert [r["step"] for r in alive] == list(range(1, STEPS + 1))
    assert any(r["replicas"] == 1 for r in alive) and alive[-1]["replicas"] == 2, alive
    assert sum(not r["replica_committed"] for r in alive) <= 2, alive
    # The restarted group recovered from the survivor and went on at its step, not at step 1.
    assert "recovered from a live group at step" in _log(logs[2])
    assert rejoined[0]["step"] > KILL_AFTER + 1 and rejoined[-1]["step"] == STEPS
    by_step = {r["step"]: r for r in alive}
    for record in rejoined:
        assert record["loss"] == by_step[record["step"]]["loss"], record
    for got, want in zip(_params(restarted, nproc), _params(survivor, nproc), strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert rel_error(got[name], want[name]) == 0.0, name

    # Before the kill both groups were in every quorum: one job over the same global batch.
    reference = tmp_path / "one-job"
    train_here(
        tiny_config,
        [
            f"--training.steps={KILL_AFTER}",
            f"--training.global_batch_size={4 * nproc}",
            f"--training.output_dir={reference}",
            "--checkpoint.enable_save=false",
        ],
    )
    expected = read_metrics(reference)
    for got in (alive[:KILL_AFTER], before[:KILL_AFTER]):
        assert [r["replicas"] for r in got] == [2] * KILL_AFTER
        # Group 0's transient fault at step 2 was recomputed on both groups; the rerun's result stands.
        assert got[1]["rerun"] == "transient" and not got[1].get("skipped"), got
        for mine, theirs in zip(got, expected, strict=True):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"]), (mine, theirs)
            assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= 1e-5 * theirs["grad_norm"], (mine, theirs)
