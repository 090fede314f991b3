"""Experiment trackers beside TensorBoard: Weights & Biases and SwanLab (rank 0 only).

Neither package is a dependency: each is imported when a run asks for it (`monitor.report_to`
or a written `monitor.wandb` / `monitor.swanlab` section), and `check_trackers` runs before the
model is built so that a missing package stops the run at once, naming the extra to install.
Each step's numeric metrics go to `train/<key>` at the step of `metrics.jsonl` (evaluation
results to `eval/<key>`), so curves line up with TensorBoard's and with `meshforge plot`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshforge.monitor.config import MonitorConfig, SwanLabConfig, WandbConfig

_PACKAGES = {"wandb": "wandb", "swanlab": "swanlab"}


class TrackerError(ValueError):
    """A tracker the config asks for cannot be used (its package is missing).

    A ValueError, as a bad config value is: `meshforge train` prints it as one line and exits 2.
    """


def check_trackers(monitor: MonitorConfig) -> None:
    """Fail fast when a requested tracker's package is not importable.

    Raises:
        TrackerError: naming the config key, the package and the extra that installs it.
    """
    for name in monitor.trackers():
        package = _PACKAGES.get(name)
        if package is not None and not _importable(package):
            raise TrackerError(_missing(name, package))


def _importable(package: str) -> bool:
    if package in sys.modules:  # imported already, or blocked with None
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def _missing(name: str, package: str) -> str:
    return (
        f"monitor.{name}: the experiment tracker needs the `{package}` package, which is not "
        f"installed; install it with `pip install meshforge[{name}]` (or `pip install {package}`), "
        f"or take {name} out of monitor.report_to and the monitor.{name} section"
    )


def _import(name: str) -> ModuleType:
    package = _PACKAGES[name]
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise TrackerError(f"{_missing(name, package)} ({type(err).__name__}: {err})") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step record's numbers under `train/` (and `eval/` for evaluation results)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key.startswith("eval_"):
            out[f"eval/{key[len('eval_') :]}"] = value
        else:
            out[f"train/{key}"] = value
    return out


class TrackerSink:
    """One tracker run: `init` with the run name and the resolved config, `log` per step, `finish`."""

    name = ""
    run_id: str | None = None

    def __init__(self, log_interval: int) -> None:
        self.log_interval = max(1, log_interval)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step % self.log_interval and not any(k.startswith("eval_") for k in record):
            return
        values = scalars(record)
        if values:
            self._log(values, step)

    def _log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbSink(TrackerSink):
    """A Weights & Biases run (`monitor.wandb`)."""

    name = "wandb"

    def __init__(
        self,
        cfg: WandbConfig,
        *,
        run_name: str,
        output_dir: Path,
        config: dict[str, object],
        resume_id: str | None = None,
    ) -> None:
        super().__init__(cfg.log_interval)
        wandb = _import("wandb")
        folder = Path(cfg.dir).expanduser() if cfg.dir else output_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name or run_name,
            entity=cfg.entity,
            mode=cfg.mode,
            tags=list(cfg.tags) or None,
            dir=str(folder),
            config=config,
            **_resume_kwargs(resume_id),
        )
        self.run_id = str(self.run.id)

    def _log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanLabSink(TrackerSink):
    """A SwanLab experiment (`monitor.swanlab`)."""

    name = "swanlab"

    def __init__(
        self,
        cfg: SwanLabConfig,
        *,
        run_name: str,
        output_dir: Path,
        config: dict[str, object],
        resume_id: str | None = None,
    ) -> None:
        super().__init__(cfg.log_interval)
        self.swanlab = _import("swanlab")
        folder = Path(cfg.dir).expanduser() if cfg.dir else output_dir / "swanlog"
        folder.mkdir(parents=True, exist_ok=True)
        self.run = self.swanlab.init(
            project=cfg.project,
            experiment_name=cfg.name or run_name,
            workspace=cfg.workspace,
            mode=cfg.mode,
            tags=list(cfg.tags) or None,
            logdir=str(folder),
            config=config,
            **_resume_kwargs(resume_id),
        )
        run_id = getattr(self.run, "id", None)
        self.run_id = str(run_id) if run_id else None

    def _log(self, values: dict[str, float], step: int) -> None:
        self.swanlab.log(values, step=step)

    def close(self) -> None:
        self.swanlab.finish()


# {output_dir}/TRACKER_RUNS: tracker name -> its run id, so that a resumed run continues those runs.
TRACKER_RUNS = "tracker_runs.json"


def _resume_kwargs(run_id: str | None) -> dict[str, str]:
    """``id`` + ``resume="allow"`` (both trackers' spelling) to continue a run, else nothing."""
    return {"id": run_id, "resume": "allow"} if run_id else {}


def _saved_runs(output_dir: Path) -> dict[str, str]:
    path = output_dir / TRACKER_RUNS
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TrackerError(f"{path}: not JSON ({exc}); delete it to start new tracker runs") from None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def build_trackers(
    monitor: MonitorConfig, *, output_dir: Path, config: dict[str, object], resuming: bool = False
) -> list[TrackerSink]:
    """The W&B and SwanLab sinks the config asks for (TensorBoard is built with the other sinks).

    Each run's id is kept in ``{output_dir}/tracker_runs.json``; a run resumed from a checkpoint
    (``resuming``) continues the runs named there (``resume="allow"``: a missing one starts anew),
    so the curves of a preempted and resumed training are one run, as with ``--resume`` in the
    HF Trainer's W&B integration. A fresh start in the same folder starts new runs.
    """
    chosen = monitor.trackers()
    saved = _saved_runs(output_dir) if resuming else {}
    sinks: list[TrackerSink] = []
    run_name = output_dir.name
    if "wandb" in chosen:
        sinks.append(
            WandbSink(
                monitor.wandb,
                run_name=run_name,
                output_dir=output_dir,
                config=config,
                resume_id=saved.get("wandb"),
            )
        )
    if "swanlab" in chosen:
        sinks.append(
            SwanLabSink(
                monitor.swanlab,
                run_name=run_name,
                output_dir=output_dir,
                config=config,
                resume_id=saved.get("swanlab"),
            )
        )
    ids = {sink.name: sink.run_id for sink in sinks if sink.run_id}
    if ids:
        (output_dir / TRACKER_RUNS).write_text(json.dumps(ids, indent=2) + "\n")
    return sinks
