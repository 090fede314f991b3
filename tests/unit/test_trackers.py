"""Weights & Biases and SwanLab sinks, driven by recording stand-ins for the two packages.

The stand-ins live in `sys.modules` under the real names, so the trainer imports them as it would
import `wandb` or `swanlab`; they record every call, which the tests check against the run's own
`metrics.jsonl` and resolved config.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from meshforge.config import config_from_dict
from meshforge.monitor.config import MonitorConfig
from meshforge.monitor.trackers import TrackerError, check_trackers, scalars
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import read_metrics


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []


def _fake_wandb(recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType("wandb")

    class Run:
        def log(self, values: dict[str, float], step: int | None = None) -> None:
            recorder.calls.append(("log", dict(values), step))

        def finish(self) -> None:
            recorder.calls.append(("finish", None, None))

    def init(**kwargs: Any) -> Run:
        recorder.calls.append(("init", kwargs, None))
        return Run()

    module.init = init  # type: ignore[attr-defined]
    return module


def _fake_swanlab(recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType("swanlab")

    def init(**kwargs: Any) -> object:
        recorder.calls.append(("init", kwargs, None))
        return object()

    def log(values: dict[str, float], step: int | None = None) -> None:
        recorder.calls.append(("log", dict(values), step))

    def finish() -> None:
        recorder.calls.append(("finish", None, None))

    module.init, module.log, module.finish = init, log, finish  # type: ignore[attr-defined]
    return module


def _monitor(**section: Any) -> MonitorConfig:
    base = {
        "model": {"model_type": "qwen3"},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
        "monitor": section,
    }
    return config_from_dict(base).monitor


def test_which_trackers_a_config_asks_for() -> None:
    assert _monitor().trackers() == []
    assert _monitor(report_to="wandb").trackers() == ["wandb"]
    assert _monitor(report_to=["swanlab", "tensorboard"]).trackers() == ["tensorboard", "swanlab"]
    assert _monitor(report_to="all").trackers() == ["tensorboard", "wandb", "swanlab"]
    # A written section switches its tracker on; `none` switches everything off.
    assert _monitor(wandb={"project": "p"}).trackers() == ["wandb"]
    assert _monitor(report_to="none", swanlab={"mode": "local"}).trackers() == []


def test_bad_tracker_names_and_modes_are_config_errors() -> None:
    from meshforge.config import ConfigError

    with pytest.raises(ConfigError, match=r"monitor\.report_to"):
        _monitor(report_to=["wandb", "mlflow"])
    with pytest.raises(ConfigError, match=r"monitor\.wandb\.mode"):
        _monitor(wandb={"mode": "cloud"})


def test_a_missing_package_names_the_key_and_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails, as when not installed
    with pytest.raises(
        TrackerError, match=r"monitor\.wandb: .*`wandb` package.*pip install meshforge\[wandb\]"
    ):
        check_trackers(_monitor(wandb={"mode": "offline"}))
    monkeypatch.setitem(sys.modules, "swanlab", None)
    with pytest.raises(TrackerError, match=r"pip install meshforge\[swanlab\]"):
        check_trackers(_monitor(report_to="swanlab"))
    check_trackers(_monitor(report_to="tensorboard"))  # no package needed beyond the dependencies


def test_scalars_keep_numbers_under_train_and_eval() -> None:
    record = {"step": 3, "loss": 2.5, "tokens": 64, "skipped": True, "skip_reason": "x", "eval_loss": 2.0}
    assert scalars(record) == {"train/loss": 2.5, "train/tokens": 64, "eval/loss": 2.0}


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_missing_package_stops_the_run_before_the_model_is_built(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshforge.config import load_config
    from meshforge.trainer import Trainer

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config(
        str(tiny_config), [f"training.output_dir={tiny_config.parent / 'run'}", "monitor.report_to=wandb"]
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    with pytest.raises(TrackerError, match=r"pip install meshforge\[wandb\]"):
        trainer.setup()
    assert not hasattr(trainer, "model")


@pytest.mark.slow
@pytest.mark.usefixtures("leave_no_process_group")
def test_a_run_logs_every_step_to_both_trackers_and_finishes_them(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshforge.config import load_config
    from meshforge.trainer import Trainer

    wandb_calls, swanlab_calls = Recorder(), Recorder()
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(wandb_calls))
    monkeypatch.setitem(sys.modules, "swanlab", _fake_swanlab(swanlab_calls))
    out = tiny_config.parent / "tracked-run"
    cfg = load_config(
        str(tiny_config),
        [
            f"training.output_dir={out}",
            "training.steps=3",
            "monitor.report_to=[wandb, swanlab, tensorboard]",
            "monitor.wandb.mode=offline",
            "monitor.wandb.tags=[tiny]",
            "monitor.swanlab.mode=local",
            "monitor.swanlab.project=meshforge-tests",
        ],
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    trainer.train()
    metrics = read_metrics(out)

    kind, init, _ = wandb_calls.calls[0]
    assert kind == "init"
    assert init["project"] == "meshforge" and init["name"] == "tracked-run" and init["mode"] == "offline"
    assert init["tags"] == ["tiny"] and init["dir"] == str(out)
    assert init["config"]["training"]["steps"] == 3
    assert init["config"]["monitor"]["report_to"] == ["wandb", "swanlab", "tensorboard"]
    # TensorBoard named without a folder of its own writes into the run folder.
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    kind, init, _ = swanlab_calls.calls[0]
    assert kind == "init"
    assert init["project"] == "meshforge-tests" and init["experiment_name"] == "tracked-run"
    assert init["mode"] == "local" and init["logdir"] == str(out / "swanlog")
    assert init["config"]["training"]["steps"] == 3

    for recorder in (wandb_calls, swanlab_calls):
        logs = [call for call in recorder.calls if call[0] == "log"]
        assert [step for _, _, step in logs] == [1, 2, 3]
        assert [values["train/loss"] for _, values, _ in logs] == [r["loss"] for r in metrics]
        assert [values["train/lr"] for _, values, _ in logs] == [r["lr"] for r in metrics]
        assert all("train/step" not in values for _, values, _ in logs)
        assert recorder.calls[-1] == ("finish", None, None)
        assert [call[0] for call in recorder.calls].count("finish") == 1
