"""`make test`'s scheduling: under `-n 2 --dist loadgroup` every `procs` test runs on one worker
(tests/_procs_group.py), the others on both."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, worker_env

# Three `procs` tests (each starts a Python) among about seventy that start nothing.
FILES = ["tests/unit/test_config_good.py", "tests/unit/test_qwen3.py"]
PROCS = {
    "tests/unit/test_config_good.py::test_config_load_does_not_import_torch",
    "tests/unit/test_config_good.py::test_each_section_module_imports_first_without_torch",
    "tests/unit/test_qwen3.py::test_config_modules_do_not_import_torch",
}


@pytest.mark.procs
def test_procs_tests_share_one_worker_and_the_rest_use_both() -> None:
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    out = subprocess.run([*cmd, *FILES], cwd=REPO, env=worker_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    worker_of = dict(
        (test, worker) for worker, test in re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", out.stdout)
    )
    assert PROCS <= set(worker_of), out.stdout[-3000:]
    assert len({worker_of[test] for test in PROCS}) == 1, {test: worker_of[test] for test in PROCS}
    assert set(worker_of.values()) == {"gw0", "gw1"}
