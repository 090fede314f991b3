"""Callbacks: the registry, import paths from the working directory, constructor arguments, the
hooks of a real run (a file next to the config), save/stop requests, and errors that name the item."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshforge.train.callbacks import (
    Callback,
    CallbackConfig,
    CallbackError,
    build_callback,
    register_callback,
    registered_callbacks,
)
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import REPO, read_metrics

RECORDER = textwrap.dedent(
    """
    import json
    from meshforge.train.callbacks import Callback


    class Recorder(Callback):
        def __init__(self, path, save_at=0, stop_at=0):
            super().__init__()
            self.path, self.save_at, self.stop_at = path, save_at, stop_at
            self.main = False

        def _write(self, *event):
            if self.main:
                with open(self.path, "a") as f:
                    f.write(json.dumps(list(event)) + "\\n")

        def on_train_start(self, info):
            self.main = info.is_main
            self._write("on_train_start", info.start_step, info.total_steps)

        def on_step_end(self, record):
            self._write("on_step_end", record["step"])
            if record["step"] == self.save_at:
                self.request_save()
            if record["step"] == self.stop_at:
                self.request_stop()

        def on_eval_end(self, metrics):
            self._write("on_eval_end", sorted(metrics))

        def on_save(self, path):
            self._write("on_save", path.name)

        def on_train_end(self, summary):
            self._write("on_train_end", summary.steps)


    class Broken(Callback):
        def on_step_end(self, record):
            if record["step"] == 2:
                raise ValueError("broken on purpose")
    """
)


@register_callback("CountSteps")
class _CountSteps(Callback):
    def __init__(self, every: int, *, label: str = "x") -> None:
        super().__init__()
        self.every, self.label = every, label


def _item(**fields: object) -> CallbackConfig:
    return CallbackConfig(**fields)  # type: ignore[arg-type]


def test_registered_names_and_constructor_arguments() -> None:
    assert registered_callbacks()["CountSteps"] is _CountSteps
    built = build_callback(_item(type="CountSteps", every=3, label="y"), 0)
    assert isinstance(built, _CountSteps) and (built.every, built.label) == (3, "y")
    assert built.config_name == "callbacks[0] (CountSteps)"
    with pytest.raises(
        CallbackError,
        match=r"^callbacks\[1\] \(CountSteps\): unknown argument\(s\) evry; it takes: every, label$",
    ):
        build_callback(_item(type="CountSteps", evry=3), 1)
    with pytest.raises(CallbackError, match=r"missing argument\(s\) every; it takes: every, label"):
        build_callback(_item(type="CountSteps"), 0)
    with pytest.raises(
        CallbackError,
        match=r"^callbacks\[0\]\.type: 'Nope' is not a registered callback \(registered: .*CountSteps",
    ):
        build_callback(_item(type="Nope"), 0)
    with pytest.raises(ValueError, match="registered twice"):
        register_callback("CountSteps")(type("Other", (Callback,), {}))


def test_import_paths_resolve_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "wd_callbacks.py").write_text(RECORDER + "\nNOT_A_CLASS = 1\n")
    (tmp_path / "wd_broken_import.py").write_text("import no_such_package_here\n")
    monkeypatch.chdir(tmp_path)
    built = build_callback(_item(type="wd_callbacks:Recorder", path="x.jsonl"), 0)
    assert type(built).__name__ == "Recorder" and built.path == "x.jsonl"  # type: ignore[attr-defined]
    assert str(tmp_path) not in sys.path  # looked up there, not left on the path
    with pytest.raises(
        CallbackError, match=r"callbacks\[2\]\.type: cannot import module 'wd_nowhere' .*ModuleNotFoundError"
    ):
        build_callback(_item(type="wd_nowhere:Recorder"), 2)
    with pytest.raises(
        CallbackError,
        match=r"cannot import module 'wd_broken_import' .*No module named 'no_such_package_here'",
    ):
        build_callback(_item(type="wd_broken_import:X"), 0)
    with pytest.raises(CallbackError, match=r"module 'wd_callbacks' \(.*wd_callbacks.py\) has no 'Missing'"):
        build_callback(_item(type="wd_callbacks:Missing"), 0)
    with pytest.raises(CallbackError, match="not a subclass of meshforge.train.callbacks.Callback"):
        build_callback(_item(type="wd_callbacks:NOT_A_CLASS"), 0)
    with pytest.raises(
        CallbackError,
        match=r"callbacks\[0\] \(wd_callbacks:Recorder\): unknown argument\(s\) oops; it takes: path, save_at, stop_at",
    ):
        build_callback(_item(type="wd_callbacks:Recorder", path="x", oops=1), 0)


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_bad_callback_fails_before_the_model_is_built(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    monkeypatch.chdir(tiny_config.parent)
    cfg = load_config(
        str(tiny_config),
        [f"training.output_dir={tiny_config.parent / 'bad'}", "callbacks=[{type: 'nowhere_mod:Thing'}]"],
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    with pytest.raises(CallbackError, match="cannot import module 'nowhere_mod'"):
        trainer.setup()
    assert not hasattr(trainer, "model")


@pytest.mark.procs
def test_a_callback_from_the_working_directory_sees_every_hook_and_can_save_and_stop(tmp_path: Path) -> None:
    (tmp_path / "my_callbacks.py").write_text(RECORDER)
    out, events = tmp_path / "run", tmp_path / "events.jsonl"
    item = f"{{type: 'my_callbacks:Recorder', path: '{events}', save_at: 3, stop_at: 4}}"
    cmd = [
        sys.executable, "-m", "meshforge", "train",
        "--config", str(REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"),
        "--training.steps=6", "--training.log_interval=1", "--train_dataset.val_size=0.1",
        "--training.eval_interval=2", "--checkpoint.save_interleaved_steps=100",
        f"--training.output_dir={out}", f"--callbacks=[{item}]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    evaluated = ["on_eval_end", ["eval_loss", "eval_tokens"]]
    assert seen == [
        ["on_train_start", 0, 6],
        ["on_step_end", 1],
        evaluated,
        ["on_step_end", 2],
        ["on_step_end", 3],
        ["on_save", "checkpoint-00000003"],  # asked for at step 3
        evaluated,
        ["on_step_end", 4],
        ["on_save", "checkpoint-00000004"],  # the stop at step 4 saves as a last step does
        ["on_train_end", 4],
    ]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_plot_curves_needs_matplotlib_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    with pytest.raises(
        CallbackError,
        match=r"^callbacks\[0\] \(PlotCurves\): .*PlotCurves needs matplotlib: matplotlib is a dependency of meshforge: reinstall it",
    ):
        build_callback(_item(type="PlotCurves"), 0)


@pytest.mark.procs  # matplotlib may start a process (its font cache)
@pytest.mark.usefixtures("leave_no_process_group")
def test_the_built_in_plot_callback_draws_the_run_at_its_end(tiny_config: Path) -> None:
    pytest.importorskip("matplotlib")
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    out = tiny_config.parent / "plotted"
    cfg = load_config(
        str(tiny_config),
        [
            "training.steps=3",
            f"training.output_dir={out}",
            "checkpoint.enable_save=false",
            "callbacks=[{type: PlotCurves}]",
        ],
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    trainer.train()
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
