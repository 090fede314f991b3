"""Shared test fixtures: offline Hugging Face, a tiny training config, and a run launcher.

Tiers are by speed and by cores. A test that starts a process (a subprocess, torchrun,
`python -m meshforge`, spawned workers) costs seconds of start-up alone and its processes take
both cores: it is marked `procs` (which implies `slow`; every test under `tests/distributed/` has
it), and `make test` runs those one at a time. A long test that starts no process is marked
`slow` only and runs on the xdist workers with the fast ones. The autouse fixture below fails a
test without `procs` as soon as it starts a process, so neither tier can hide one.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests._procs_group import (  # noqa: F401  (hooks of this conftest)
    pytest_configure,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
    record_group,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# No end-of-run plot (monitor.plot_curves) in the many short test runs: drawing costs seconds
# each; tests/unit/test_callbacks_default_plot.py switches it back on.
os.environ.setdefault("MESHFORGE_PLOT", "0")

REPO = Path(__file__).resolve().parent.parent


DISTRIBUTED = REPO / "tests" / "distributed"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/distributed/ starts ranks: `procs`; every `procs` test is `slow`;
    under `--dist loadgroup` the `procs` tests are one group (tests/_procs_group.py)."""
    for item in items:
        if item.path.is_relative_to(DISTRIBUTED) and item.get_closest_marker("procs") is None:
            item.add_marker(pytest.mark.procs)
        if item.get_closest_marker("procs") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    record_group(config, items)


@pytest.fixture(autouse=True)
def _processes_need_the_procs_mark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test without the `procs` mark as soon as it starts a process."""
    if request.node.get_closest_marker("procs") is not None:
        return

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise pytest.fail.Exception(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.procs (tests/conftest.py)",
            pytrace=False,
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True)
def _leave_no_process_group() -> Iterator[None]:
    """Destroy a default process group a test left behind (an in-process run joins one of its own).

    The next test in this interpreter may initialise its own, which torch refuses while one exists.
    Looked up in `sys.modules` so that torch-free tests do not import torch.
    """
    dist = sys.modules.get("torch.distributed")
    existed = dist is not None and dist.is_initialized()
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and not existed and dist.is_initialized():
        dist.destroy_process_group()


TINY_CONFIG = """
training:
  steps: 4
  local_batch_size: 2
  global_batch_size: 4
  seed: 7
  deterministic: true
  log_interval: 1
optimizer:
  type: AdamW
  weight_decay: 0.1
lr_scheduler:
  type: ConstantWarmUpLR
  learning_rate: 3.e-3
  warmup_steps: 2
train_dataset:
  dataloader:
    type: TextDataLoader
    data_path: {data}
    seq_length: 32
    shuffle: true
model:
  model_type: qwen3
  tokenizer_name_or_path: meshforge://assets/tokenizer
  vocab_size: 8192
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 16
  tie_word_embeddings: true
checkpoint:
  save_interleaved_steps: 2
  save_max: 3
"""


def write_corpus(path: Path, num_docs: int = 300) -> Path:
    """A small deterministic English-like corpus (no network, no bundled-corpus tokenisation cost)."""
    words = (
        "the model reads a file and returns the value of each key in order while the loader keeps "
        "its position so that a resumed run sees exactly the same samples as before"
    ).split()
    with path.open("w") as f:
        for i in range(num_docs):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 30))
            f.write(json.dumps({"text": f"Document {i}: {text}."}) + "\n")
    return path


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_CONFIG.format(data=corpus))
    return cfg


def worker_env() -> dict[str, str]:
    """The environment of a meshforge subprocess: one thread per process, unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def meshforge_cmd(*args: str, nproc: int = 1) -> list[str]:
    """`python -m meshforge ARGS`, under torchrun (standalone, `nproc` processes) when nproc > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "meshforge", *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [sys.executable, *launcher, "-m", "meshforge", *args]


def run_train(
    config: Path, overrides: list[str], *, nproc: int = 1, cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run `meshforge train` in fresh processes (torchrun when nproc > 1); fail with its output."""
    cmd = meshforge_cmd("train", "--config", str(config), *overrides, nproc=nproc)
    proc = subprocess.run(cmd, cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def meshforge_here(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`meshforge ARGS` in this process, in `cwd`: its exit code, stdout and stderr as a process's.

    The same `meshforge.cli.main.main` that `python -m meshforge` runs, without the interpreter
    and torch start-up; for tests of what a command prints and returns. An exception the command
    lets escape (a traceback a user would see) fails the test with that traceback. The process
    entry itself (`python -m meshforge`, torchrun, signals) keeps real processes. The command
    leaves no process group behind (`meshforge train` destroys its own on every path).
    """
    from meshforge.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["meshforge", *args], code, out.getvalue(), err.getvalue())


def train_cli(config: Path, overrides: list[str], *, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`run_train` in this process (`meshforge_here`): for tests of a run, not of its process."""
    proc = meshforge_here("train", "--config", str(config), *overrides, cwd=cwd)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def train_here(
    config: Path,
    overrides: list[str],
    *,
    log: Callable[[str], None] | None = None,
    trainer_cls: type | None = None,
) -> None:
    """A whole `meshforge train` run in this process: one rank of a spawn, or a single process.

    Cheaper than `run_train` (no fresh interpreter per run); the runs of a layout comparison share
    one spawn through `tests.distributed._spawn.train_runs`. `log` receives the trainer's log lines
    (what `meshforge train` prints); by default they are dropped. `trainer_cls` replaces the
    `Trainer` (a subclass that injects a fault).
    """
    import torch.distributed as dist

    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    existed = dist.is_initialized()
    log = log or (lambda _line: None)
    # The config's own notes first, as `meshforge train` prints them before the trainer's lines.
    trainer = (trainer_cls or Trainer)(load_config(str(config), overrides, log=log), log=log)
    try:
        trainer.setup()
        trainer.train()
    finally:
        # A single-process run joins a process group of its own: leave none behind for the
        # tests that follow in this interpreter (a spawned rank's group belongs to the spawn).
        if not existed and dist.is_initialized():
            dist.destroy_process_group()


# The four-step run with attention dropout that the resume and security tests start from: a
# resumed run equals the uninterrupted one only when every RNG is restored.
DROPOUT = "--model.attention_dropout=0.2"


def train_four_steps(config: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`meshforge train` of four steps with dropout into `out` (in this process: `meshforge_here`)."""
    return meshforge_here(
        "train",
        "--config",
        str(config),
        "--training.steps=4",
        f"--training.output_dir={out}",
        DROPOUT,
        *overrides,
        cwd=out.parent,
    )


@pytest.fixture(scope="module")
def four_step_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """The tiny config and an uninterrupted 4-step run with checkpoints at steps 2 and 4 (one per
    test module that asks)."""
    root = tmp_path_factory.mktemp("four-steps")
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG.format(data=write_corpus(root / "corpus.jsonl")))
    run = root / "full"
    proc = train_four_steps(config, run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return config, run, read_metrics(run)
