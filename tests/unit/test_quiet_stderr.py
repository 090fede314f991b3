"""stderr carries meshforge's own lines and real warnings: no torchao extension messages, no
deprecation lines about torchao's enums, no progress bars unless stderr is a terminal."""

from __future__ import annotations

import enum
import importlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshforge.utils.quiet import quiet_library_output
from tests.conftest import meshforge_here

#: What the libraries printed on a non-terminal stderr before the policy.
NOISE = re.compile(r"Failed to load|Skipping import of cpp extensions|is deprecated|Warning:|it/s\]|\r")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _captured(name: str, monkeypatch: pytest.MonkeyPatch) -> _Records:
    """The records that pass `name`'s own filters, kept from the terminal for this test."""
    logger = logging.getLogger(name)
    handler = _Records()
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    monkeypatch.setattr(logger, "handlers", [handler])
    return handler


def _torchao_enum() -> type[enum.Enum]:
    kind = enum.Enum("KernelPreference", "AUTO")
    kind.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    return kind


def test_known_library_messages_are_dropped_and_others_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    torchao = _captured("torchao", monkeypatch)
    pytree = _captured("torch.utils._pytree", monkeypatch)
    quiet_library_output(_Terminal(), environ={})
    quiet_library_output(_Terminal(), environ={})  # a second call adds no second filter
    assert sum(type(f).__name__ == "_DropKnownNoise" for f in logging.getLogger("torchao").filters) == 1

    so = "/venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    logging.getLogger("torchao").warning(f"Failed to load {so}: Could not load this library: {so}")
    logging.getLogger("torchao").warning(
        "Skipping import of cpp extensions due to incompatible torch version."
    )
    logging.getLogger("torchao").warning("Config has an unsupported dtype")
    template = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
        "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
    )
    logging.getLogger("torch.utils._pytree").warning(template, _torchao_enum())
    logging.getLogger("torch.utils._pytree").warning(template, enum.Enum("Mine", "A"))
    assert torchao.messages == ["Config has an unsupported dtype"]
    assert len(pytree.messages) == 1 and pytree.messages[0].startswith("<enum 'Mine'>")

    # Python's warnings are not touched: an unrelated warning, deprecations included, still shows.
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_library_output(io.StringIO(), environ={})
        warnings.warn("the tokenizer has no pad token", UserWarning, stacklevel=1)
        warnings.warn("`foo` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["the tokenizer has no pad token", "`foo` is deprecated"]
    assert warnings.filters == before


@pytest.fixture
def bars_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """datasets' and transformers' bars switched on, and back to their state after the test.

    datasets gives its environment variable, as read when it was imported, priority over its
    switch functions; an earlier in-process command of this interpreter may have set it.
    """
    import datasets
    import transformers.utils.logging as hf_logging

    # `datasets.utils.tqdm` the attribute is the bar class; the module holds the variable.
    datasets_tqdm = importlib.import_module("datasets.utils.tqdm")
    monkeypatch.setattr(datasets_tqdm, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    was = datasets.utils.logging.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled()
    datasets.enable_progress_bars()
    hf_logging.enable_progress_bar()
    yield
    (datasets.enable_progress_bars if was[0] else datasets.disable_progress_bars)()
    (hf_logging.enable_progress_bar if was[1] else hf_logging.disable_progress_bar)()


@pytest.mark.usefixtures("bars_on")
def test_progress_bars_stay_on_a_terminal_only() -> None:
    import datasets
    import transformers.utils.logging as hf_logging

    env: dict[str, str] = {}
    quiet_library_output(_Terminal(), environ=env)
    assert env == {}
    assert datasets.utils.logging.is_progress_bar_enabled() and hf_logging.is_progress_bar_enabled()

    quiet_library_output(io.StringIO(), environ=env)
    assert env == {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    assert not datasets.utils.logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()


@pytest.mark.usefixtures("bars_on")
def test_a_users_own_setting_keeps_the_bars_in_a_log_file() -> None:
    import datasets

    env = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}
    quiet_library_output(io.StringIO(), environ=env)
    assert env == {"HF_DATASETS_DISABLE_PROGRESS_BARS": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    assert datasets.utils.logging.is_progress_bar_enabled()


def test_sft_data_preparation_writes_no_progress_bar_to_a_log(tmp_path: Path) -> None:
    """`meshforge data preview` (the SFT data path of `meshforge train`) with stderr captured."""
    # Rows of this folder alone: datasets' cache has none, so the split is generated and mapped.
    rows = [{"instruction": f"{tmp_path.name} question {i}", "output": f"answer {i}"} for i in range(8)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json"}}))
    config = tmp_path / "sft.yaml"
    config.write_text(
        "training:\n  stage: sft\n  local_batch_size: 2\n  global_batch_size: 2\n"
        "train_dataset:\n  dataloader:\n    type: SFTDataLoader\n"
        f"  dataset: rows\n  dataset_dir: {tmp_path}\n  template: qwen3\n  cutoff_len: 64\n  packing: true\n"
        "model:\n  model_type: qwen3\n  tokenizer_name_or_path: meshforge://assets/tokenizer\n"
    )
    proc = meshforge_here("data", "preview", "-c", str(config), "-n", "1", "-o", "rows.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not NOISE.search(proc.stderr), proc.stderr


@pytest.mark.slow
@pytest.mark.procs
def test_generate_prints_only_its_own_lines_on_a_piped_stderr(tmp_path: Path) -> None:
    """`python -m meshforge generate` on a tiny Hugging Face folder (the transformers backend,
    which imports torchao through transformers' quantizers) with stderr on a pipe."""
    from tests.unit._generate_fixtures import save_family, write_config

    folder = save_family(tmp_path / "qwen3", "qwen3")
    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folder}")
    cmd = [sys.executable, "-m", "meshforge", "generate", "-c", str(config), "--prompt", "the model"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        env.pop(var, None)  # what this test process was given does not decide for the command
    proc = subprocess.run(
        [*cmd, "--max-new-tokens", "2"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "### --prompt #1" in proc.stdout
    assert not NOISE.search(proc.stderr), proc.stderr
