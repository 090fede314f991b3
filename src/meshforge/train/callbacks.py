"""Training callbacks: the base class, the registry, and the `callbacks:` list items.

A callback subclasses `Callback` and overrides any of its hooks. Built-in callbacks register a
name with `@register_callback("Name")`; a config item names one by `type`, or any class by import
path (`package.module:ClassName`, importable from the working directory too). Every other key of
the item goes to the constructor; a key the constructor does not take is an error that lists the
parameters it does take.

Callbacks run on every rank (`TrainInfo.is_main` tells rank 0, which writes the run's files).
A hook may call `request_save()` (a checkpoint after this step) or `request_stop()` (end the run
after this step, as if it were the last); the ranks agree on requests, and on a failure, in one
all-reduce after each step, only when the run has callbacks of its own. An exception in a hook
stops the run on every rank with one line naming the callback (`CallbackError`).

Light at import: the config imports this module, so it must not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import field_validator

from meshforge.config.base import PassthroughSection, describe

if TYPE_CHECKING:
    from meshforge.monitor.config import MonitorConfig

HOOKS = ("on_train_start", "on_step_end", "on_eval_end", "on_save", "on_train_end")


class CallbackConfig(PassthroughSection):
    """One extra callback; other keys are its constructor arguments."""

    type: str = describe(..., "Registered callback name, or an import path `package.module:ClassName`.")

    @field_validator("type")
    @classmethod
    def _non_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a registered callback or `package.module:ClassName`")
        return value


@dataclass(frozen=True)
class TrainInfo:
    """What `on_train_start` receives."""

    rank: int
    world_size: int
    is_main: bool
    output_dir: Path
    start_step: int
    total_steps: int


class Callback:
    """Base class of training callbacks: every hook does nothing until overridden."""

    #: How messages name this callback (`callbacks[0] (my_callbacks:Recorder)`); set when built.
    config_name: str = ""

    def __init__(self) -> None:
        self._save_requested = False
        self._stop_requested = False

    def request_save(self) -> None:
        """Ask for a checkpoint after the current step."""
        self._save_requested = True

    def request_stop(self) -> None:
        """Ask the run to end after the current step (with the checkpoint of a last step)."""
        self._stop_requested = True

    def take_requests(self) -> tuple[bool, bool]:
        """(save, stop) asked since the last call; clears them."""
        # getattr: a subclass that forgot super().__init__() still works.
        requests = (getattr(self, "_save_requested", False), getattr(self, "_stop_requested", False))
        self._save_requested = self._stop_requested = False
        return requests

    def on_train_start(self, info: TrainInfo) -> None:
        """Before the first step (after resume: `info.start_step` steps are done)."""

    def on_step_end(self, record: dict[str, Any]) -> None:
        """After each step, with its `metrics.jsonl` record."""

    def on_eval_end(self, metrics: dict[str, float]) -> None:
        """After an evaluation, with `eval_loss` and `eval_tokens` (and, when each evaluation dataset
        is evaluated on its own, `eval_loss/<name>` and `eval_tokens/<name>` per dataset)."""

    def on_save(self, path: Path) -> None:
        """After a checkpoint was written (with async saving: handed to the background writer)."""

    def on_train_end(self, summary: Any) -> None:
        """After the last step, with the run's `TrainSummary`."""


class BuiltinCallback(Callback):
    """An always-on callback of the trainer itself (metrics, checkpoints, profiler window, plot).

    The trainer calls these directly, in a fixed order, on every rank: no guard (their errors are
    the run's own) and no agreement. Besides the user hooks they have the two ends of a step: the
    loop calls `on_step_begin` before the step runs and `on_step_close` last, after the ranks
    agreed on the user callbacks' requests (`save`, `stop`), so that a built-in can act on them.
    """

    def on_step_begin(self, step: int) -> None:
        """Before step `step` (1-based) runs."""

    def on_step_close(self, step: int, *, save: bool, stop: bool) -> None:
        """The last thing of step `step`, with the agreed requests of the user callbacks."""


class CallbackError(RuntimeError):
    """A callback could not be resolved or built (before the first step); the message names it."""


class CallbackHookError(CallbackError):
    """One of this rank's callbacks raised in a hook; every rank stops at the same point."""


class PeerCallbackError(CallbackError):
    """Another rank's callback raised (that rank printed why); this rank stops with it."""


_C = TypeVar("_C", bound=type[Callback])
_REGISTRY: dict[str, type[Callback]] = {}


def register_callback(name: str) -> Callable[[_C], _C]:
    """Class decorator: make a `Callback` subclass available as `type: <name>`."""

    def add(cls: _C) -> _C:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"callback name {name!r} is registered twice ({_REGISTRY[name].__qualname__})")
        _REGISTRY[name] = cls
        return cls

    return add


def registered_callbacks() -> dict[str, type[Callback]]:
    return dict(_REGISTRY)


@register_callback("PlotCurves")
class PlotCurves(Callback):
    """Built in: the run's curves (`meshforge plot`) as `{output_dir}/metrics.png` (or `output`)
    when the run ends, on rank 0. Needs matplotlib, checked when the callback is built."""

    def __init__(self, output: str | None = None) -> None:
        super().__init__()
        if importlib.util.find_spec("matplotlib") is None:
            raise CallbackError(f"PlotCurves needs matplotlib: {_PLOT_EXTRA}")
        self.output = output
        self.info: TrainInfo | None = None

    def on_train_start(self, info: TrainInfo) -> None:
        self.info = info

    def on_train_end(self, summary: Any) -> None:
        if self.info is None or not self.info.is_main:
            return
        from meshforge.monitor.plot import plot_runs

        out = Path(self.output) if self.output else self.info.output_dir / "metrics.png"
        plot_runs([self.info.output_dir], out)
        print(f"plot: {out}", flush=True)


_PLOT_EXTRA = "matplotlib is a dependency of meshforge: reinstall it (pip install meshforge)"


def builtin_callbacks(
    monitor: MonitorConfig, items: list[CallbackConfig], *, warn: Callable[[str], None]
) -> list[BuiltinCallback]:
    """The always-on callbacks of a run that depend on the config alone (the trainer adds those
    built from its own parts: the checkpoint saver and the profiler window).

    The end-of-run plot: `monitor.plot_curves` (default on; `MESHFORGE_PLOT=0` switches it
    off for test harnesses and sweeps, where drawing costs seconds per run), unless a
    `PlotCurves` item of `callbacks:` draws it already. matplotlib is a dependency; in an
    environment that lost it the plot is skipped with one warning: a missing plotting package
    must not stop a training run.
    """
    plots: list[BuiltinCallback] = []
    if monitor.plot_loss:
        # Asked for by name (LLaMA-Factory's plot_loss): MESHFORGE_PLOT does not switch it off.
        if importlib.util.find_spec("matplotlib") is None:
            warn(
                f"warning: monitor.plot_loss: no training_loss.png, matplotlib is not installed ({_PLOT_EXTRA})"
            )
        else:
            plots.append(_LossPlot(warn))
    if not monitor.plot_curves or os.environ.get("MESHFORGE_PLOT", "1") == "0":
        return plots
    if any(_REGISTRY.get(item.type) is PlotCurves for item in items):
        return plots
    if importlib.util.find_spec("matplotlib") is None:
        warn(f"warning: monitor.plot_curves: no end-of-run plot, matplotlib is not installed ({_PLOT_EXTRA})")
        return plots
    plot = _DefaultPlot(warn)
    plot.config_name = "monitor.plot_curves (PlotCurves)"
    return [*plots, plot]


class _DefaultPlot(PlotCurves, BuiltinCallback):
    """The plot nobody asked for by name: a run it cannot draw (no records) gets a warning."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        super().__init__()
        self.warn = warn

    def on_train_end(self, summary: Any) -> None:
        from meshforge.monitor.plot import PlotError

        try:
            super().on_train_end(summary)
        except PlotError as err:
            self.warn(f"warning: monitor.plot_curves: no plot ({err})")


class _LossPlot(BuiltinCallback):
    """`monitor.plot_loss`: LLaMA-Factory's `training_loss.png` when the run ends, on rank 0."""

    config_name = "monitor.plot_loss"

    def __init__(self, warn: Callable[[str], None]) -> None:
        super().__init__()
        self.warn = warn
        self.info: TrainInfo | None = None

    def on_train_start(self, info: TrainInfo) -> None:
        self.info = info

    def on_train_end(self, summary: Any) -> None:
        if self.info is None or not self.info.is_main:
            return
        from meshforge.monitor.plot import PlotError, plot_loss

        try:
            out = plot_loss(self.info.output_dir)
        except PlotError as err:
            self.warn(f"warning: monitor.plot_loss: no plot ({err})")
            return
        print(f"plot: {out}", flush=True)


def resolve_callback_type(type_name: str, where: str) -> type[Callback]:
    """The class a `type` names: a registered name, or `package.module:ClassName`.

    The working directory is searched too, so a `my_callbacks.py` next to the config works as
    `my_callbacks:Recorder`. Errors name `where` (e.g. `callbacks[0].type`), the module and the cause.
    """
    if type_name in _REGISTRY:
        return _REGISTRY[type_name]
    if ":" not in type_name:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise CallbackError(
            f"{where}: {type_name!r} is not a registered callback (registered: {known}); "
            "name a class as 'package.module:ClassName'"
        )
    module_name, _, attr = type_name.partition(":")
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module can fail to import in any way: report it, named
        raise CallbackError(
            f"{where}: cannot import module {module_name!r} for {type_name!r} "
            f"({type(err).__name__}: {err}); it must be importable from the working directory {cwd} "
            "or the Python path"
        ) from err
    finally:
        if added:
            sys.path.remove(cwd)
    cls = getattr(module, attr, None)
    if cls is None:
        raise CallbackError(f"{where}: module {module_name!r} ({module.__file__}) has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise CallbackError(f"{where}: {type_name} is not a subclass of meshforge.train.callbacks.Callback")
    return cls


def build_callback(item: CallbackConfig, index: int) -> Callback:
    """Construct one `callbacks:` item; unknown or missing arguments name the parameters."""
    where = f"callbacks[{index}]"
    cls = resolve_callback_type(item.type, f"{where}.type")
    kwargs = item.extra
    params = inspect.signature(cls.__init__).parameters
    named = [
        p for n, p in params.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    accepted = ", ".join(p.name for p in named) or "none"
    unknown = sorted(set(kwargs) - {p.name for p in named})
    if unknown and not takes_any:
        raise CallbackError(
            f"{where} ({item.type}): unknown argument(s) {', '.join(unknown)}; it takes: {accepted}"
        )
    missing = [p.name for p in named if p.default is p.empty and p.name not in kwargs]
    if missing:
        raise CallbackError(
            f"{where} ({item.type}): missing argument(s) {', '.join(missing)}; it takes: {accepted}"
        )
    try:
        callback = cls(**kwargs)
    except Exception as err:  # the user's constructor: report it, named
        raise CallbackError(
            f"{where} ({item.type}): the constructor raised {type(err).__name__}: {err}"
        ) from err
    callback.config_name = f"{where} ({item.type})"
    return callback


def build_callbacks(items: list[CallbackConfig]) -> list[Callback]:
    return [build_callback(item, i) for i, item in enumerate(items)]
