"""Parallel layouts compared with one process, in as few process starts as possible.

A 2-process torchrun launch costs 6-9 s before the first step (each fresh interpreter imports
torch again, about 2.6 s here), so a comparison of several layouts
trains each single-process reference in the test process and every layout of one world size in
one spawn (`run_workers`), in the order given: a checkpoint written by one run can be loaded by
the next run of that spawn, or by a later group.

* `train_all`: whole `meshforge train` runs (`Run`), each with its metrics.jsonl (and, when
  asked, the log lines `meshforge train` prints) left in its output folder for the test to read;
* `train_one`: one such run, called like `tests.conftest.run_train` (its `stdout` holds rank 0's
  log lines), for a test that checks what a run logs and writes rather than the CLI around it;
* `assert_layouts_equal_one_process`: the trainer's steps of each layout against one process,
  every layout checked and every mismatch reported together;
* `run_checks`: module-level checks (a name and a function of the rank and a 1-D mesh) in one
  spawn, a failure named after its check.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.distributed._spawn import run_workers


@dataclass(frozen=True)
class Run:
    """One `meshforge train` run: `config` with `overrides` on `nproc` ranks.

    `log`, when set, is the file that receives rank 0's log lines (the `meshforge train` output
    a test may assert on).
    """

    config: Path
    overrides: list[str] = field(default_factory=list)
    nproc: int = 1
    log: Path | None = None


def runs_by_tuning(
    config: Path,
    base: list[str],
    tunings: dict[str, list[str]],
    layouts: dict[str, dict[str, list[str]]],
    root: Path,
) -> tuple[list[Run], list[Run]]:
    """Each tuning's one-process run (`root/<tuning>/one`) and its 2-rank runs, one per layout
    of `layouts[tuning]` (`root/<tuning>/<layout>`)."""
    one = [
        Run(config, [*base, *extra, f"--training.output_dir={root / name / 'one'}"])
        for name, extra in tunings.items()
    ]
    two = [
        Run(config, [*base, *extra, *layout, f"--training.output_dir={root / name / key}"], 2)
        for name, extra in tunings.items()
        for key, layout in layouts[name].items()
    ]
    return one, two


def _train(run: Run, rank: int) -> None:
    import torch

    from tests.conftest import train_here

    # `training.deterministic` turns torch's deterministic algorithms on for the whole process:
    # a run in the test process gives the setting back, so the tests after it see their own.
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    lines: list[str] = []
    try:
        train_here(run.config, run.overrides, log=lines.append)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if run.log is not None and rank == 0:
        run.log.write_text("".join(f"{line}\n" for line in lines))


def _train_worker(rank: int, world: int, runs: list[Run]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    for run in runs:
        _train(run, rank)


def train_all(runs: Sequence[Run], *, timeout: float = 600) -> None:
    """Train `runs` in order: single-process runs here, each stretch of same-size runs in one spawn."""
    for nproc, group in itertools.groupby(runs, key=lambda run: run.nproc):
        batch = list(group)
        if nproc == 1:
            for run in batch:
                _train(run, 0)
        else:
            run_workers(_train_worker, nproc, batch, timeout=timeout)


@dataclass(frozen=True)
class Trained:
    """What `train_one` leaves for the test: rank 0's log lines (`meshforge train`'s output, less
    the CLI's closing summary)."""

    stdout: str


def train_one(
    config: Path, overrides: list[str], *, nproc: int = 1, cwd: Path | None = None, timeout: float = 600
) -> Trained:
    """One whole trainer run in `cwd`: here for one process, in the shared rank pool for more.

    The in-process counterpart of `tests.conftest.run_train` (no interpreter, torch import or
    torchrun launch per run); a failing rank fails the test with its traceback.
    """
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(cwd or Path.cwd()):
        log = Path(tmp) / "train.log"
        train_all([Run(config, overrides, nproc, log)], timeout=timeout)
        return Trained(log.read_text())


def _compare_worker(
    rank: int,
    world: int,
    config: str,
    base: list[str],
    layouts: dict[str, list[str]],
    root: str,
    want: list[tuple[float, float]],
    tolerances: tuple[float, float],
) -> None:
    from tests.unit.test_recompute import train_records

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    loss_rel, norm_rel = tolerances
    failures = []
    for name, extra in layouts.items():
        out = Path(root) / name.replace(" ", "_")
        got = train_records(Path(config), [*base, *extra], out, steps=len(want))
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want, strict=True)):
            if loss != pytest.approx(want_loss, rel=loss_rel) or norm != pytest.approx(
                want_norm, rel=norm_rel
            ):
                failures.append(f"{name} step {step + 1}: {(loss, norm)} != {(want_loss, want_norm)}")
    assert not failures, "\n".join(failures)


def assert_layouts_equal_one_process(
    config: Path,
    base: list[str],
    layouts: dict[str, list[str]],
    out: Path,
    *,
    steps: int = 2,
    world: int = 2,
    loss_rel: float = 1e-5,
    norm_rel: float = 1e-4,
) -> None:
    """Each layout's `(loss, grad_norm)` per step equals one process's (`config` + `base`).

    The reference trains in this process and must change its loss every step (it trains);
    the layouts (`{name: overrides}`) then run one after another in one spawn of `world` ranks.

    Raises:
        AssertionError: Naming every layout and step that differs.
    """
    from tests.unit.test_recompute import train_records

    want = train_records(config, base, out / "one", steps=steps)
    assert len({loss for loss, _ in want}) == steps, f"the one-process run does not train: {want}"
    run_workers(_compare_worker, world, str(config), base, layouts, str(out), want, (loss_rel, norm_rel))


Check = tuple[str, Callable[..., None]]


def _check_worker(rank: int, world: int, checks: list[Check]) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)  # the same default-RNG stream on every rank, for checks that build from it
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    for name, check in checks:
        try:
            check(rank, mesh)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


def run_checks(checks: Sequence[Check], *, world: int = 2) -> None:
    """Run each `(name, check)` as `check(rank, mesh)` (a 1-D mesh over `world` ranks) in one spawn.

    A check compares its layout with a one-process reference it builds itself, and raises on a
    difference; the checks stop at the first failure (the ranks may be inside a collective of the
    failed check), which is named in the test's failure.
    """
    run_workers(_check_worker, world, list(checks))
