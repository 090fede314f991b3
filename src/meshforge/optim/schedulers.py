"""Learning-rate schedules selected by `lr_scheduler.type`, with MindFormers names and semantics.

Every schedule is first a pure function `lr_at(t) -> float` of the 0-based step index `t`
(`lr_schedule`), which tests and plots use directly, then wrapped in a torch `LRScheduler`
(`build_lr_scheduler`) that sets each parameter group's `lr` to it.

Conventions (shared by all types):

* Optimizer step k (1-based, as logged in `metrics.jsonl`) uses `lr_at(k - 1)`. The scheduler
  is built before the first step (its `last_epoch` becomes 0) and stepped after each optimizer
  step, so `scheduler.last_epoch` always equals the number of optimizer steps done.
* Warm-up is linear from `warmup_lr_init` (default 0) at t = 0 to `learning_rate` at
  t = warmup_steps: `lr_at(t) = init + (lr - init) * t / warmup_steps`. As in MindFormers (and
  Hugging Face's schedules) the first step therefore runs at `warmup_lr_init`.
* `warmup_steps` wins over `warmup_ratio` when both are given (MindFormers lets the ratio win;
  an explicit count is the less surprising choice). `warmup_ratio` gives
  `int(total_steps * warmup_ratio)` steps.
* `total_steps` is `training.steps` unless the section sets `total_steps` > 0 (null, -1 or 0
  keep `training.steps`, as in MindFormers); a longer horizon lets a short run follow the
  schedule of a longer one (e.g. run k steps now, resume to 2k later with identical values). A schedule reads it only where its values depend on
  it: `ConstantWarmUpLR` with `warmup_steps` (or without warm-up) never does, so its values do not
  change when a run is extended and resumed.
* `min_lr` (MindSpeed's name) is an alias of `lr_end`; giving both is an error. An explicit
  floor above `learning_rate` is an error.
* `lr_scheduler.type: null` means a constant `learning_rate` and takes no options.

Types:

* `ConstantWarmUpLR`: warm-up, then `learning_rate`.
* `LinearWithWarmUpLR`: warm-up, then linear decay reaching `lr_end` (default 0) at
  t = total_steps: `lr_end + (lr - lr_end) * max(0, (T - t) / max(1, T - W))`. MindFormers decays
  to 0 and has no `lr_end`; with the default the values are identical.
* `CosineWithWarmUpLR`: warm-up, then
  `lr_end + (lr - lr_end) * max(0, 0.5 * (1 + cos(2 pi num_cycles (t - W) / max(1, D - W))))`
  for W <= t < D, and `lr_end` from t = D on, where D = `decay_steps`, else
  `int(total_steps * decay_ratio)`, else total_steps. Deliberate difference: MindFormers always
  stretches the cosine over total_steps - W and jumps to `lr_end` at D; here the cosine ends at
  D, so there is no jump (identical when D = total_steps, the default).
* `WarmUpStableDecayLR`: warm-up, constant `learning_rate` until S, then linear decay reaching
  `lr_end` (default 1e-7, as in MindFormers) at total_steps and held after. S =
  `decay_start_steps`, else `int(T * decay_start_ratio)`, else `T - int(T * decay_ratio)`
  (`decay_ratio` = share of the run spent decaying, the common WSD knob), else the end of the
  warm-up (no stable phase).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from meshforge.optim.specs import resolve_scheduler_options

if TYPE_CHECKING:
    import torch

__all__ = ["build_lr_scheduler", "lr_schedule"]

_S = "lr_scheduler"


class _Total:
    """Resolves total_steps on first use, so that schedules that never need it never check it."""

    def __init__(self, from_training: int | None, from_options: int | None) -> None:
        self._training = from_training
        self._options = from_options if from_options is not None and from_options > 0 else None

    def get(self, why: str) -> int:
        total = self._options if self._options is not None else self._training
        if total is None or isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise ValueError(
                f"{_S}: {why} needs the total number of steps (training.steps or {_S}.total_steps), "
                f"got {total!r}"
            )
        return total


def _warmup_steps(opts: Mapping[str, Any], total: _Total) -> int:
    """Warm-up length: `warmup_steps`, else `int(total * warmup_ratio)`, else 0."""
    if opts.get("warmup_steps") is not None:
        return int(opts["warmup_steps"])
    if opts.get("warmup_ratio") is not None:
        return int(total.get("warmup_ratio") * opts["warmup_ratio"])
    return 0


def _warmup(lr: float, init: float, warmup: int) -> Callable[[int], float]:
    def at(t: int) -> float:
        return init + (lr - init) * t / warmup

    return at


def _check_floor(lr: float, options: Mapping[str, Any], lr_end: float) -> None:
    explicit = "min_lr" if "min_lr" in options else "lr_end" if "lr_end" in options else None
    if explicit and lr_end > lr:
        raise ValueError(
            f"{_S}.{explicit}: the final learning rate ({lr_end:g}) is above "
            f"{_S}.learning_rate ({lr:g}); the decay would increase it"
        )


def _check_warmup_fits(warmup: int, end: int, end_name: str) -> None:
    if warmup > end:
        raise ValueError(f"{_S}.warmup_steps: the warm-up ({warmup} steps) is longer than {end_name} ({end})")


def lr_schedule(
    type: str | None,  # noqa: A002 - mirrors the config key
    learning_rate: float,
    total_steps: int | None,
    options: Mapping[str, Any],
) -> Callable[[int], float]:
    """The pure schedule `lr_at(t)` for 0-based step index t (see the module docstring).

    Args:
        type: `lr_scheduler.type`; None for a constant learning rate.
        learning_rate: `lr_scheduler.learning_rate`, the peak.
        total_steps: `training.steps`; only read by schedules whose values depend on it.
        options: the section's passthrough keys (raw YAML values are fine: `"1e-5"` works).

    Returns:
        A function of t >= 0 returning the learning rate.

    Raises:
        ValueError: naming `lr_scheduler.<key>` for a bad option, an unknown or unbuilt type,
            a warm-up longer than the schedule, or a floor above the peak.
    """
    lr = float(learning_rate)
    if isinstance(learning_rate, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{_S}.learning_rate: must be a finite number >= 0, got {learning_rate!r}")
    canon, opts = resolve_scheduler_options(type, options)
    if canon is None:
        return lambda t: lr
    total = _Total(total_steps, opts.get("total_steps"))
    warmup = _warmup_steps(opts, total)
    init = float(opts.get("warmup_lr_init") or 0.0)
    ramp = _warmup(lr, init, warmup)

    if canon == "ConstantWarmUpLR":
        return lambda t: ramp(t) if t < warmup else lr

    lr_end = float(opts["lr_end"])
    _check_floor(lr, options, lr_end)

    if canon == "LinearWithWarmUpLR":
        T = total.get(canon)
        _check_warmup_fits(warmup, T, "the schedule")
        span = max(1, T - warmup)

        def linear(t: int) -> float:
            if t < warmup:
                return ramp(t)
            return lr_end + (lr - lr_end) * max(0.0, (T - t) / span)

        return linear

    if canon == "CosineWithWarmUpLR":
        if opts.get("decay_steps") is not None:
            D = int(opts["decay_steps"])
            end_name = f"{_S}.decay_steps"
        elif opts.get("decay_ratio") is not None:
            D = int(total.get("decay_ratio") * opts["decay_ratio"])
            end_name = f"int(total_steps * {_S}.decay_ratio)"
        else:
            D = total.get(canon)
            end_name = "the schedule"
        _check_warmup_fits(warmup, D, end_name)
        span = max(1, D - warmup)
        cycles = float(opts["num_cycles"])

        def cosine(t: int) -> float:
            if t >= D:
                return lr_end
            if t < warmup:
                return ramp(t)
            progress = (t - warmup) / span
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress)))
            return lr_end + (lr - lr_end) * factor

        return cosine

    if canon == "WarmUpStableDecayLR":
        T = total.get(canon)
        _check_warmup_fits(warmup, T, "the schedule")
        if opts.get("decay_start_steps") is not None:
            S, start_key = int(opts["decay_start_steps"]), "decay_start_steps"
        elif opts.get("decay_start_ratio") is not None:
            S, start_key = int(T * opts["decay_start_ratio"]), "decay_start_ratio"
        elif opts.get("decay_ratio") is not None:
            S, start_key = T - int(T * opts["decay_ratio"]), "decay_ratio"
        else:
            S, start_key = warmup, ""
        if start_key and not warmup <= S <= T:
            raise ValueError(
                f"{_S}.{start_key}: the decay would start at step {S}, which must lie between the end "
                f"of the warm-up ({warmup}) and the total steps ({T})"
            )
        span = max(1, T - S)

        def wsd(t: int) -> float:
            if t < warmup:
                return ramp(t)
            if t < S:
                return lr
            return lr - (lr - lr_end) * min(1.0, (t - S) / span)

        return wsd

    raise AssertionError(f"scheduler {canon} has a spec but no implementation")  # pragma: no cover


@functools.cache
def _scheduler_class() -> type:
    # torch is imported here, not at module level, so that config validation can call
    # `lr_schedule` (to check warm-up against total steps) without importing torch.
    from torch.optim.lr_scheduler import LRScheduler

    class ScheduleLR(LRScheduler):
        """Sets every group's lr to `lr_fn(last_epoch)`, scaled by the group's own base lr
        relative to the peak (1.0 for the groups `build_optimizer` makes)."""

        def __init__(
            self, optimizer: torch.optim.Optimizer, lr_fn: Callable[[int], float], peak_lr: float
        ) -> None:
            self.lr_fn = lr_fn
            self.peak_lr = float(peak_lr)
            super().__init__(optimizer, last_epoch=-1)

        def get_lr(self) -> list[float]:
            value = self.lr_fn(self.last_epoch)
            return [value * (base / self.peak_lr if self.peak_lr > 0 else 1.0) for base in self.base_lrs]

        def state_dict(self) -> dict[str, Any]:
            # The schedule itself is rebuilt from the config; only the position is state.
            state = super().state_dict()
            state.pop("lr_fn", None)
            return state

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            state = dict(state_dict)
            state.pop("lr_fn", None)
            super().load_state_dict(state)
            # Re-apply the lr of the restored position: the optimizer's groups may come from a
            # fresh optimizer (no_load_optim) and still hold lr_at(0).
            lrs = self.get_lr()
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            self._last_lr = lrs

    return ScheduleLR


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    type: str | None,  # noqa: A002 - mirrors the config key
    learning_rate: float,
    total_steps: int | None,
    options: Mapping[str, Any],
) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the torch scheduler for `lr_scheduler:`.

    Call it once, before the first optimizer step; call `scheduler.step()` after every
    optimizer step. `state_dict()`/`load_state_dict()` round-trip the position (a plain dict
    of numbers), and loading re-applies the restored lr to the optimizer.

    Args:
        optimizer: the optimizer, whose groups' `lr` is `learning_rate` (as `build_optimizer`
            makes them).
        type, learning_rate, total_steps, options: as for `lr_schedule`.

    Returns:
        A `torch.optim.lr_scheduler.LRScheduler`.
    """
    lr_fn = lr_schedule(type, learning_rate, total_steps, options)
    return _scheduler_class()(optimizer, lr_fn, learning_rate)
