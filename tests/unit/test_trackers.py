"""Weights & Biases and SwanLab sinks: W&B for real in offline mode (the run read back from its
`.wandb` file), SwanLab through a recording stand-in.

The stand-in lives in `sys.modules` under the real name, so the trainer imports it as it would
import `swanlab`; it records every call, which the test checks against the run's own
`metrics.jsonl` and resolved config. A missing package is `None` in `sys.modules`.
"""

from __future__ import annotations

import json
import struct
import sys
import types
import zlib
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


def _fake_swanlab(recorder: Recorder) -> types.ModuleType:
    module = types.ModuleType("swanlab")

    def init(**kwargs: Any) -> object:
        recorder.calls.append(("init", kwargs, None))
        return types.SimpleNamespace(id=kwargs.get("id") or "swan-run-1")

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
    from meshforge.train.trainer import Trainer

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config(
        str(tiny_config), [f"training.output_dir={tiny_config.parent / 'run'}", "monitor.report_to=wandb"]
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    with pytest.raises(TrackerError, match=r"pip install meshforge\[wandb\]"):
        trainer.setup()
    assert not hasattr(trainer, "model")


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline W&B run's `.wandb` file, parsed with wandb's own protobufs.

    The file is W&B's 7-byte header (`:W&B`, 0xBEE1, version) and then a LevelDB-style log:
    32 KiB blocks of chunks (crc32, length, type: full, first, middle, last), a record split over
    chunks where it crosses a block, a block tail too short for a chunk header padded with zeros.
    wandb 0.31 has no Python reader of its own (the Go core writes the file).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    magic, ident, _version = struct.unpack("<4sHB", data[:7])
    assert (magic, ident) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    block, header = 32768, 7
    records, pending, pos = [], b"", 7
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0 and length == 0:  # the zero padding of a block's end
            pos += left
            continue
        chunk = data[pos + header : pos + header + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad checksum at byte {pos}"
        pending += chunk
        pos += header + length
        if kind in (1, 4):  # full or last: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.mark.procs  # a tracker's writer process
@pytest.mark.usefixtures("leave_no_process_group")
def test_a_run_logs_every_step_to_both_trackers_finishes_them_and_a_resumed_run_continues_them(
    tiny_config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """W&B for real, in offline mode (its run read back from disk); SwanLab through its stand-in."""
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    pytest.importorskip("wandb")
    for var, sub in (
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest owns stdout
    monkeypatch.delenv("WANDB_MODE", raising=False)
    swanlab_calls = Recorder()
    monkeypatch.setitem(sys.modules, "swanlab", _fake_swanlab(swanlab_calls))
    out = tiny_config.parent / "tracked-run"
    overrides = [
        f"training.output_dir={out}",
        "training.steps=3",
        "monitor.report_to=[wandb, swanlab, tensorboard]",
        "monitor.wandb.mode=offline",
        "monitor.wandb.tags=[tiny]",
        "monitor.swanlab.mode=local",
        "monitor.swanlab.project=meshforge-tests",
    ]
    cfg = load_config(str(tiny_config), overrides)
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    trainer.train()
    metrics = read_metrics(out)
    import wandb

    # `finish` hands the run to wandb's service process, which writes the file's tail after; the
    # file is complete once the service is gone (at interpreter exit in a real run).
    wandb.teardown()

    # The offline run: one folder under the run's output folder (monitor.wandb.dir unset).
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    records = _wandb_records(log_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds.count("exit") == 1  # finished once
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "meshforge" and run.display_name == "tracked-run" and list(run.tags) == ["tiny"]
    config = {_item_key(i): json.loads(i.value_json) for i in run.config.update}
    for r in records:  # config updates after init, if any
        if r.WhichOneof("record_type") == "config":
            config.update({_item_key(i): json.loads(i.value_json) for i in r.config.update})
    assert config["training"]["steps"] == 3
    assert config["training"]["output_dir"] == str(out)
    assert config["monitor"]["report_to"] == ["wandb", "swanlab", "tensorboard"]
    history = [
        {_item_key(i): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in metrics]
    assert [h["train/lr"] for h in history] == [r["lr"] for r in metrics]
    assert [h["train/grad_norm"] for h in history] == [r["grad_norm"] for r in metrics]
    assert all("train/step" not in h for h in history)

    # TensorBoard named without a folder of its own writes into the run folder.
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    kind, init, _ = swanlab_calls.calls[0]
    assert kind == "init"
    assert init["project"] == "meshforge-tests" and init["experiment_name"] == "tracked-run"
    assert init["mode"] == "local" and init["logdir"] == str(out / "swanlog")
    assert init["config"]["training"]["steps"] == 3
    logs = [call for call in swanlab_calls.calls if call[0] == "log"]
    assert [step for _, _, step in logs] == [1, 2, 3]
    assert [values["train/loss"] for _, values, _ in logs] == [r["loss"] for r in metrics]
    assert [values["train/lr"] for _, values, _ in logs] == [r["lr"] for r in metrics]
    assert all("train/step" not in values for _, values, _ in logs)
    assert swanlab_calls.calls[-1] == ("finish", None, None)
    assert [call[0] for call in swanlab_calls.calls].count("finish") == 1
    assert "id" not in init and "resume" not in init  # a fresh run starts new tracker runs

    # Resumed from the step-3 checkpoint, the run continues the same W&B run and SwanLab experiment.
    saved = json.loads((out / "tracker_runs.json").read_text())
    assert saved == {"wandb": run.run_id, "swanlab": "swan-run-1"}
    swanlab_calls.calls.clear()
    resumed = Trainer(
        load_config(
            str(tiny_config),
            [
                *overrides[:1],
                "training.steps=5",
                *overrides[2:],
                f"checkpoint.load_path={out / 'checkpoints' / 'checkpoint-00000003'}",
            ],
        ),
        log=lambda _m: None,
    )
    resumed.setup()
    assert resumed.step == 3
    resumed.train()
    wandb.teardown()
    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(d.name.endswith(f"-{run.run_id}") for d in run_dirs)
    (second,) = [d for d in run_dirs if d != run_dir]
    records = _wandb_records(next(second.glob("run-*.wandb")))
    (again,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert again.run_id == run.run_id
    steps = [
        json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
        if _item_key(i) == "_step"
    ]
    assert steps == [4, 5]
    kind, init, _ = swanlab_calls.calls[0]
    assert kind == "init" and init["id"] == "swan-run-1" and init["resume"] == "allow"
    assert [step for k, _, step in swanlab_calls.calls if k == "log"] == [4, 5]
