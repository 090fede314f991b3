"""Learning-rate schedules selected by `lr_scheduler.type`, with MindFormers names and semantics.

Every schedule is first a pure function `lr_at(t) -> float` of the 0-based step index `t`
(`lr_schedule`), which tests and plots use directly, then wrapped in a torch `LRScheduler`
(`build_lr_scheduler`) that sets each parameter group's `lr` to it.

Conventions (shared by all types):

* Optimizer step k (1-based, as logged in `metrics.jsonl`) uses `lr_at(k - 1)`. The scheduler
  is built before the first step (its `last_epoch` becomes 0) and stepped after each optimizer
  step, so `scheduler.last_epoch` always equals the number of optimizer steps done.
  With `training.rampup_batch_size` the schedule is read at `samples consumed /
  training.global_batch_size` instead (a fraction while the batch ramps), as Megatron counts its
  schedule in samples (`data/rampup.py`).
* Warm-up is linear from `warmup_lr_init` (default 0) at t = 0 to `learning_rate` at
  t = warmup_steps: `lr_at(t) = init + (lr - init) * t / warmup_steps`. As in MindFormers (and
  Hugging Face's schedules) the first step therefore runs at `warmup_lr_init`.
* `warmup_steps` wins over `warmup_ratio` when both are given (MindFormers lets the ratio win;
  an explicit count is the less surprising choice). `warmup_ratio` gives
  `int(total_steps * warmup_ratio)` steps.
* `total_steps` is `training.steps` unless the section sets `total_steps` > 0 (null, -1 or 0
  keep `training.steps`, as in MindFormers); a longer horizon lets a short run follow the
  schedule of a longer one (run k steps now, resume to 2k later with identical values).
  A schedule reads it only where its values depend on it: `ConstantWarmUpLR` with
  `warmup_steps` (or without warm-up) never does, so its values do not change when a run is
  extended and resumed.
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
* `PolynomialWithWarmUpLR`: warm-up, then `lr_end + (lr - lr_end) * (1 - (t - W) / L) ** power`
  for W <= t < W + L, `lr_end` after, with L = `decay_steps`, else total_steps - W (`power` 1.0,
  `lr_end` 1e-7 by default, as in MindFormers). Deliberate difference: MindFormers compares the
  absolute step with L and so drops to `lr_end` W steps early; here the decay lasts L steps.
* `CosineWithRestartsAndWarmUpLR`: warm-up, then `num_cycles` (default 1) hard-restarted
  half-cosines from `learning_rate` to `lr_end` between W and D (`decay_steps`, default
  total_steps), `lr_end` from D on (MindFormers returns 0 there; `lr_end` is the floor it asked for).
* `CosineAnnealingLR`: `eta_min + (lr - eta_min) * (1 + cos(pi t / t_max)) / 2`, periodic, no
  warm-up; `t_max` is required. Never reads total_steps.
* `CosineAnnealingWarmRestarts` (SGDR): the same over periods `t_0`, `t_0 * t_mult`, ...,
  restarting at `learning_rate`; `t_0` is required. Never reads total_steps.

* `ConstantWithCoolDownLR` (MindFormers, after DeepSeek-V3's schedule): warm-up over W steps,
  `learning_rate` for `keep_steps` (K), then over D steps
  `lr_end1 + (lr - lr_end1) * max(0, 0.5 * (1 + cos(2 pi num_cycles (t - W - K) / D)))` for
  W + K <= t < W + K + D, `lr_end1` for the next `final_steps` (F) steps and `lr_end2` from
  t = W + K + D + F on. D = `decay_steps`, else `int(total_steps * decay_ratio)`, else
  total_steps (MindFormers' default: the cool-down is as long as the run, not what is left of
  it). Differences, kept consistent with the other types: `decay_steps` wins over `decay_ratio`
  and `warmup_steps` over `warmup_ratio` (MindFormers lets the ratios win); `lr_end2: 0` means 0
  (MindFormers' `lr_end2 or lr_end1` turns an explicit 0 into `lr_end1`; only null does here);
  an `lr_end1` above `learning_rate` is an error.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshforge.optim.options import (
    ConstantWithCoolDownLROptions,
    CosineAnnealingLROptions,
    CosineAnnealingWarmRestartsOptions,
    CosineWithRestartsAndWarmUpLROptions,
    CosineWithWarmUpLROptions,
    DecayToEndOptions,
    PolynomialWithWarmUpLROptions,
    SchedulerOptions,
    WarmupOptions,
    WarmUpStableDecayLROptions,
)
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


@dataclass
class _Ctx:
    """What every schedule builder gets: the peak, typed options, the lazy total, the warm-up."""

    canon: str
    lr: float
    opts: SchedulerOptions  # the options dataclass of `canon` (optim/options.py)
    raw: Mapping[str, object]  # the options as written, to tell an explicit lr_end from a default
    total: _Total
    warmup: int = 0
    init: float = 0.0

    def ramp(self, t: int) -> float:
        return self.init + (self.lr - self.init) * t / self.warmup

    def lr_end(self) -> float:
        assert isinstance(self.opts, DecayToEndOptions)
        lr_end = self.opts.lr_end
        explicit = "min_lr" if "min_lr" in self.raw else "lr_end" if "lr_end" in self.raw else None
        if explicit and lr_end > self.lr:
            raise ValueError(
                f"{_S}.{explicit}: the final learning rate ({lr_end:g}) is above "
                f"{_S}.learning_rate ({self.lr:g}); the decay would increase it"
            )
        return lr_end

    def fits(self, end: int, end_name: str) -> None:
        if self.warmup > end:
            raise ValueError(
                f"{_S}.warmup_steps: the warm-up ({self.warmup} steps) is longer than {end_name} ({end})"
            )

    def decay_end(self, *, ratio: bool) -> tuple[int, str]:
        """The step where a cosine-type decay ends: decay_steps, int(T*decay_ratio), or T."""
        o = self.opts
        assert isinstance(o, CosineWithWarmUpLROptions | CosineWithRestartsAndWarmUpLROptions)
        if o.decay_steps is not None:
            end, name = o.decay_steps, f"{_S}.decay_steps"
        elif ratio and isinstance(o, CosineWithWarmUpLROptions) and o.decay_ratio is not None:
            end = int(self.total.get("decay_ratio") * o.decay_ratio)
            name = f"int(total_steps * {_S}.decay_ratio)"
        else:
            end, name = self.total.get(self.canon), "the schedule"
        self.fits(end, name)
        return end, name


def _constant(c: _Ctx) -> Callable[[int], float]:
    return lambda t: c.ramp(t) if t < c.warmup else c.lr


def _cooldown(c: _Ctx) -> Callable[[int], float]:
    o = c.opts
    assert isinstance(o, ConstantWithCoolDownLROptions)
    lr, warmup, keep, final = c.lr, c.warmup, o.keep_steps, o.final_steps
    if o.decay_steps is not None:
        decay = o.decay_steps
    elif o.decay_ratio is not None:
        decay = max(1, int(c.total.get("decay_ratio") * o.decay_ratio))
    else:
        decay = c.total.get(c.canon)
    if o.lr_end1 > lr:
        raise ValueError(
            f"{_S}.lr_end1: the learning rate after the cool-down ({o.lr_end1:g}) is above "
            f"{_S}.learning_rate ({lr:g}); the cool-down would increase it"
        )
    end1 = o.lr_end1
    end2 = end1 if o.lr_end2 is None else o.lr_end2
    hold_end, decay_end = warmup + keep, warmup + keep + decay
    final_end = decay_end + final

    def at(t: int) -> float:
        if t < warmup:
            return c.ramp(t)
        if t < hold_end:
            return lr
        if t < decay_end:
            progress = (t - hold_end) / decay
            factor = 0.5 * (1.0 + math.cos(math.pi * 2.0 * o.num_cycles * progress))
            return end1 + (lr - end1) * max(0.0, factor)
        return end1 if t < final_end else end2

    return at


def _linear(c: _Ctx) -> Callable[[int], float]:
    lr, lr_end, warmup, T = c.lr, c.lr_end(), c.warmup, c.total.get(c.canon)
    c.fits(T, "the schedule")
    span = max(1, T - warmup)

    def at(t: int) -> float:
        if t < warmup:
            return c.ramp(t)
        return lr_end + (lr - lr_end) * max(0.0, (T - t) / span)

    return at


def _cosine(c: _Ctx) -> Callable[[int], float]:
    lr, lr_end, warmup = c.lr, c.lr_end(), c.warmup
    D, _ = c.decay_end(ratio=True)
    span = max(1, D - warmup)
    assert isinstance(c.opts, CosineWithWarmUpLROptions)
    cycles = c.opts.num_cycles

    def at(t: int) -> float:
        if t >= D:
            return lr_end
        if t < warmup:
            return c.ramp(t)
        factor = 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * (t - warmup) / span))
        return lr_end + (lr - lr_end) * max(0.0, factor)

    return at


def _wsd(c: _Ctx) -> Callable[[int], float]:
    lr, lr_end, warmup, T = c.lr, c.lr_end(), c.warmup, c.total.get(c.canon)
    c.fits(T, "the schedule")
    o = c.opts
    assert isinstance(o, WarmUpStableDecayLROptions)
    if o.decay_start_steps is not None:
        S, key = o.decay_start_steps, "decay_start_steps"
    elif o.decay_start_ratio is not None:
        S, key = int(T * o.decay_start_ratio), "decay_start_ratio"
    elif o.decay_ratio is not None:
        S, key = T - int(T * o.decay_ratio), "decay_ratio"
    else:
        S, key = warmup, ""
    if key and not warmup <= S <= T:
        raise ValueError(
            f"{_S}.{key}: the decay would start at step {S}, which must lie between the end "
            f"of the warm-up ({warmup}) and the total steps ({T})"
        )
    span = max(1, T - S)

    def at(t: int) -> float:
        if t < warmup:
            return c.ramp(t)
        if t < S:
            return lr
        return lr - (lr - lr_end) * min(1.0, (t - S) / span)

    return at


def _polynomial(c: _Ctx) -> Callable[[int], float]:
    o = c.opts
    assert isinstance(o, PolynomialWithWarmUpLROptions)
    lr, lr_end, warmup, power = c.lr, c.lr_end(), c.warmup, o.power
    if o.decay_steps is not None:
        span = o.decay_steps
    else:
        T = c.total.get(c.canon)
        c.fits(T, "the schedule")
        span = max(1, T - warmup)

    def at(t: int) -> float:
        if t < warmup:
            return c.ramp(t)
        if t >= warmup + span:
            return lr_end
        return lr_end + (lr - lr_end) * (1.0 - (t - warmup) / span) ** power

    return at


def _cosine_restarts(c: _Ctx) -> Callable[[int], float]:
    lr, lr_end, warmup = c.lr, c.lr_end(), c.warmup
    D, _ = c.decay_end(ratio=False)
    span = max(1, D - warmup)
    assert isinstance(c.opts, CosineWithRestartsAndWarmUpLROptions)
    cycles = c.opts.num_cycles

    def at(t: int) -> float:
        if t >= D:
            return lr_end
        if t < warmup:
            return c.ramp(t)
        phase = (cycles * (t - warmup) / span) % 1.0
        return lr_end + (lr - lr_end) * 0.5 * (1.0 + math.cos(math.pi * phase))

    return at


def _cosine_annealing(c: _Ctx) -> Callable[[int], float]:
    assert isinstance(c.opts, CosineAnnealingLROptions)
    lr, eta_min, t_max = c.lr, c.opts.eta_min, c.opts.t_max
    # Periodic like torch's closed form: back at learning_rate after 2 * t_max steps.
    return lambda t: eta_min + (lr - eta_min) * 0.5 * (1.0 + math.cos(math.pi * t / t_max))


def _cosine_warm_restarts(c: _Ctx) -> Callable[[int], float]:
    o = c.opts
    assert isinstance(o, CosineAnnealingWarmRestartsOptions)
    lr, eta_min, t_0, t_mult = c.lr, o.eta_min, o.t_0, o.t_mult

    def at(t: int) -> float:
        # Integer walk over the periods (t_0, t_0*t_mult, ...): exact at every restart, unlike
        # the closed form through log(), which can misplace a boundary by rounding.
        period = t_0
        if t_mult == 1:
            t %= t_0
        else:
            while t >= period:
                t -= period
                period *= t_mult
        return eta_min + (lr - eta_min) * 0.5 * (1.0 + math.cos(math.pi * t / period))

    return at


_BUILDERS: dict[str, Callable[[_Ctx], Callable[[int], float]]] = {
    "ConstantWarmUpLR": _constant,
    "ConstantWithCoolDownLR": _cooldown,
    "LinearWithWarmUpLR": _linear,
    "CosineWithWarmUpLR": _cosine,
    "WarmUpStableDecayLR": _wsd,
    "PolynomialWithWarmUpLR": _polynomial,
    "CosineWithRestartsAndWarmUpLR": _cosine_restarts,
    "CosineAnnealingLR": _cosine_annealing,
    "CosineAnnealingWarmRestarts": _cosine_warm_restarts,
}


def lr_schedule(
    type: str | None,  # noqa: A002 - mirrors the config key
    learning_rate: float,
    total_steps: int | None,
    options: Mapping[str, object],
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
    horizon = opts.total_steps if isinstance(opts, WarmupOptions) else None
    ctx = _Ctx(canon=canon, lr=lr, opts=opts, raw=options, total=_Total(total_steps, horizon))
    if isinstance(opts, WarmupOptions):
        if opts.warmup_steps is not None:
            ctx.warmup = opts.warmup_steps
        elif opts.warmup_ratio is not None:
            ctx.warmup = int(ctx.total.get("warmup_ratio") * opts.warmup_ratio)
        ctx.init = opts.warmup_lr_init
    return _BUILDERS[canon](ctx)


@functools.cache
def _scheduler_class() -> type:
    # torch is imported here, not at module level, so that config validation can call
    # `lr_schedule` (to check warm-up against total steps) without importing torch.
    from torch.optim.lr_scheduler import LRScheduler

    class ScheduleLR(LRScheduler):
        """Sets every group's lr to `lr_fn(last_epoch)`, scaled by the group's own base lr
        relative to the peak (1.0 for the groups `build_optimizer` makes)."""

        def __init__(
            self,
            optimizer: torch.optim.Optimizer,
            lr_fn: Callable[[int], float],
            peak_lr: float,
            position: Callable[[int], float] | None = None,
        ) -> None:
            self.lr_fn = lr_fn
            self.peak_lr = float(peak_lr)
            self.position = position
            super().__init__(optimizer, last_epoch=-1)

        def get_lr(self) -> list[float | torch.Tensor]:
            t = self.last_epoch if self.position is None else self.position(self.last_epoch)
            value = self.lr_fn(t)  # type: ignore[arg-type]
            return [value * (base / self.peak_lr if self.peak_lr > 0 else 1.0) for base in self.base_lrs]

        def state_dict(self) -> dict[str, Any]:
            # The schedule itself is rebuilt from the config; only the position is state.
            state = super().state_dict()
            state.pop("lr_fn", None)
            state.pop("position", None)
            return state

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            state = dict(state_dict)
            state.pop("lr_fn", None)
            state.pop("position", None)
            if len(state.get("base_lrs", self.base_lrs)) != len(self.base_lrs):
                # Another number of param groups than the saving run (e.g. the unsharded groups
                # of parallelism.ignored_modules): keep this optimizer's own base lrs.
                state.pop("base_lrs")
                state.pop("_last_lr", None)
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
    options: Mapping[str, object],
    position: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the torch scheduler for `lr_scheduler:`.

    Call it once, before the first optimizer step; call `scheduler.step()` after every
    optimizer step. `state_dict()`/`load_state_dict()` round-trip the position (a plain dict
    of numbers), and loading re-applies the restored lr to the optimizer.

    Args:
        optimizer: the optimizer, whose groups' `lr` is `learning_rate` (as `build_optimizer`
            makes them).
        type, learning_rate, total_steps, options: as for `lr_schedule`.
        position: maps the optimizer steps done to the schedule's position (None: the same
            number). A batch-size ramp (`data/rampup.py`) counts full-batch steps of samples.

    Returns:
        A `torch.optim.lr_scheduler.LRScheduler`.
    """
    lr_fn = lr_schedule(type, learning_rate, total_steps, options)
    return _scheduler_class()(optimizer, lr_fn, learning_rate, position)
