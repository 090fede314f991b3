"""`--dist loadgroup` with the `procs` tests as one group: one xdist worker runs them one at a
time while the other takes the tests that start no process, and joins them once the group is done.

A test that starts processes leaves most of a core idle (its ranks wait on each other's
messages), so running it beside a one-process test costs it little; two of them side by side
oversubscribe the cores and both slow down. pytest-xdist 3.8's own `xdist_group` mark does not
group under pytest 9.2 (it renames `item._nodeid`, which pytest 9 no longer reads), so the
grouping is done here: each worker writes the ids of the `procs` tests it collected to a file the
controller's scheduler reads, and that scheduler puts them into one work unit.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

_LIST_VAR = "MESHFORGE_PROCS_TEST_IDS"
GROUP = "procs"


def pytest_configure(config: pytest.Config) -> None:
    """On the controller: name the file the workers (started after this, with this environment)
    write the group's test ids to."""
    if not hasattr(config, "workerinput"):
        os.environ[_LIST_VAR] = str(Path(tempfile.gettempdir()) / f"meshforge-procs-{uuid.uuid4().hex}.txt")


def record_group(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker under `--dist loadgroup`: write the ids of the `procs` tests."""
    path = os.environ.get(_LIST_VAR)
    if path is None or not hasattr(config, "workerinput") or not config.getoption("loadgroup", False):
        return
    ids = [item.nodeid for item in items if item.get_closest_marker(GROUP) is not None]
    part = Path(f"{path}.{os.getpid()}")
    part.write_text("\n".join(ids))
    part.replace(path)  # every worker collects the same tests: the last complete file wins


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup`: the scheduler that groups the `procs` tests (None: xdist's own)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    path = Path(os.environ[_LIST_VAR])

    class ProcsGroupScheduling(LoadGroupScheduling):
        _grouped: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._grouped is None:
                # Read once the collections are in: every worker wrote the file while collecting.
                self._grouped = frozenset(path.read_text().splitlines()) if path.exists() else frozenset()
            return GROUP if nodeid in self._grouped else nodeid

    return ProcsGroupScheduling(config, log)  # type: ignore[arg-type]


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        path = os.environ.get(_LIST_VAR)
        if path is not None:
            Path(path).unlink(missing_ok=True)
