"""LR schedules: values at key steps, option checks, the torch scheduler and its state round trip."""

from __future__ import annotations

import json
import math

import pytest

from meshforge.optim.schedulers import build_lr_scheduler, lr_schedule
from meshforge.optim.specs import check_scheduler_options, scheduler_not_built

LR = 1e-3


def approx(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_no_type_is_constant_and_takes_no_options() -> None:
    f = lr_schedule(None, LR, 100, {})
    assert [f(t) for t in (0, 50, 10**6)] == [LR, LR, LR]
    with pytest.raises(ValueError, match=r"lr_scheduler\.warmup_steps: lr_scheduler\.type is not set"):
        lr_schedule(None, LR, 100, {"warmup_steps": 5})


def test_constant_warmup_values() -> None:
    f = lr_schedule("ConstantWarmUpLR", LR, None, {"warmup_steps": 4, "warmup_lr_init": 1e-4})
    assert f(0) == approx(1e-4)  # step 1 runs at warmup_lr_init
    assert f(2) == approx(1e-4 + (LR - 1e-4) * 0.5)
    assert f(4) == approx(LR)  # reached at t = warmup_steps
    assert f(1000) == approx(LR)


def test_constant_warmup_does_not_read_total_steps() -> None:
    # Neither None nor a nonsense total is looked at: the values cannot depend on it.
    for total in (None, 0, 10, 10_000):
        f = lr_schedule("ConstantWarmUpLR", LR, total, {"warmup_steps": 10})
        assert [f(t) for t in (0, 5, 10, 11)] == [0.0, LR / 2, LR, LR]
    assert lr_schedule("ConstantWarmUpLR", LR, None, {})(0) == LR  # no warm-up at all


def test_warmup_ratio_and_precedence() -> None:
    f = lr_schedule("ConstantWarmUpLR", LR, 200, {"warmup_ratio": 0.05})  # int(200*0.05) = 10
    assert f(5) == approx(LR / 2) and f(10) == approx(LR)
    g = lr_schedule("ConstantWarmUpLR", LR, 200, {"warmup_ratio": 0.05, "warmup_steps": 4})
    assert g(2) == approx(LR / 2) and g(4) == approx(LR)  # warmup_steps wins
    with pytest.raises(ValueError, match=r"lr_scheduler: warmup_ratio needs the total number of steps"):
        lr_schedule("ConstantWarmUpLR", LR, None, {"warmup_ratio": 0.1})
    # MindFormers' reference example: warmup_ratio 0 is no warm-up.
    assert lr_schedule("ConstantWarmUpLR", LR, 100, {"warmup_ratio": 0})(0) == LR


def test_linear_values() -> None:
    T, W = 110, 10
    f = lr_schedule("LinearWithWarmUpLR", LR, T, {"warmup_steps": W})
    assert f(0) == 0.0 and f(5) == approx(LR / 2) and f(W) == approx(LR)
    assert f(60) == approx(LR * 0.5)  # midpoint of the decay
    assert f(T - 1) == approx(LR / 100)  # the last step (k = T) runs at lr * 1/(T - W)
    assert f(T) == 0.0 and f(T + 50) == 0.0
    g = lr_schedule("LinearWithWarmUpLR", LR, T, {"warmup_steps": W, "min_lr": 1e-4})
    assert g(60) == approx(1e-4 + (LR - 1e-4) * 0.5) and g(T) == approx(1e-4) and g(10**5) == approx(1e-4)


def test_cosine_values_mindformers_default() -> None:
    T, W = 110, 10
    f = lr_schedule("CosineWithWarmUpLR", LR, T, {"warmup_steps": W, "lr_end": 1e-5})
    assert f(0) == 0.0 and f(W) == approx(LR)
    assert f(60) == approx(1e-5 + (LR - 1e-5) * 0.5)  # midpoint: half-way down
    t = 35
    expect = 1e-5 + (LR - 1e-5) * 0.5 * (1 + math.cos(math.pi * (t - W) / (T - W)))
    assert f(t) == approx(expect)
    assert f(T) == approx(1e-5) and f(T + 100) == approx(1e-5)  # floor


def test_cosine_decay_steps_and_ratio_end_the_cosine() -> None:
    f = lr_schedule("CosineWithWarmUpLR", LR, 1000, {"warmup_steps": 10, "decay_steps": 110, "min_lr": 0})
    assert f(60) == approx(LR / 2) and f(109) > 0 and f(110) == 0.0 and f(500) == 0.0
    # decay_steps + warmup_steps: the values do not depend on the total.
    assert lr_schedule("CosineWithWarmUpLR", LR, None, {"warmup_steps": 10, "decay_steps": 110})(
        60
    ) == approx(LR / 2)
    g = lr_schedule("CosineWithWarmUpLR", LR, 1000, {"warmup_steps": 10, "decay_ratio": 0.11})
    assert g(60) == approx(LR / 2) and g(110) == 0.0


def test_cosine_num_cycles() -> None:
    f = lr_schedule("CosineWithWarmUpLR", LR, 100, {"num_cycles": 1.0})
    assert f(50) == approx(0.0) and f(99) == approx(LR * 0.5 * (1 + math.cos(2 * math.pi * 0.99)))


def test_wsd_values() -> None:
    T = 100
    f = lr_schedule(
        "WarmUpStableDecayLR", LR, T, {"warmup_steps": 10, "decay_start_steps": 60, "lr_end": 1e-5}
    )
    assert f(0) == 0.0 and f(10) == approx(LR) and f(59) == approx(LR) and f(60) == approx(LR)
    assert f(80) == approx(LR - (LR - 1e-5) * 0.5)  # midpoint of the decay
    assert f(T) == approx(1e-5) and f(T + 10) == approx(1e-5)
    # decay_ratio: the last 20% decays; decay_start_ratio: decay starts at 60%.
    g = lr_schedule("WarmUpStableDecayLR", LR, T, {"warmup_ratio": 0.1, "decay_ratio": 0.2, "min_lr": 0})
    assert g(79) == approx(LR) and g(90) == approx(LR / 2) and g(T) == 0.0
    h = lr_schedule("WarmUpStableDecayLR", LR, T, {"decay_start_ratio": 0.6, "min_lr": 0})
    assert h(0) == LR and h(80) == approx(LR / 2)
    # Nothing given: decay right after the warm-up, to MindFormers' default floor 1e-7.
    k = lr_schedule("WarmUpStableDecayLR", LR, T, {"warmup_steps": 10})
    assert k(55) == approx(LR - (LR - 1e-7) * 0.5) and k(T) == approx(1e-7)


def test_polynomial_values() -> None:
    T, W = 110, 10
    f = lr_schedule("PolynomialWithWarmUpLR", LR, T, {"warmup_steps": W, "power": 2.0, "lr_end": 1e-5})
    assert f(0) == 0.0 and f(W) == approx(LR)
    assert f(60) == approx(1e-5 + (LR - 1e-5) * 0.25)  # midpoint: (1 - 1/2) ** 2
    assert f(T - 1) == approx(1e-5 + (LR - 1e-5) * 0.01**2)  # still decaying on the last step
    assert f(T) == approx(1e-5) and f(T + 7) == approx(1e-5)
    g = lr_schedule("PolynomialWithWarmUpLR", LR, None, {"warmup_steps": W, "decay_steps": 20, "min_lr": 0})
    assert g(20) == approx(LR / 2) and g(30) == 0.0  # decay_steps is the length after the warm-up
    assert lr_schedule("PolynomialWithWarmUpLR", LR, 100, {})(100) == approx(1e-7)  # MindFormers floor


def test_cosine_with_restarts_values() -> None:
    T, W = 110, 10
    f = lr_schedule("CosineWithRestartsAndWarmUpLR", LR, T, {"warmup_steps": W, "num_cycles": 2})
    assert f(5) == approx(LR / 2) and f(W) == approx(LR)
    assert f(35) == approx(LR / 2)  # half-way through the first of two cycles
    assert f(59) == approx(LR * 0.5 * (1 + math.cos(math.pi * 0.98)))  # near the bottom
    assert f(60) == approx(LR)  # hard restart
    assert f(85) == approx(LR / 2) and f(T) == 0.0 and f(500) == 0.0


def test_cosine_annealing_values() -> None:
    f = lr_schedule("CosineAnnealingLR", LR, None, {"t_max": 10, "eta_min": 1e-4})
    assert f(0) == approx(LR) and f(5) == approx(1e-4 + (LR - 1e-4) / 2) and f(10) == approx(1e-4)
    assert f(20) == approx(LR)  # periodic, as torch's closed form
    g = lr_schedule("CosineAnnealingWarmRestarts", LR, None, {"t_0": 4, "t_mult": 2})
    # Periods 4, 8, 16: restarts at t = 4, 12, 28.
    assert [g(t) == approx(LR) for t in (0, 4, 12, 28)] == [True] * 4
    assert g(2) == approx(LR / 2) and g(8) == approx(LR / 2) and g(20) == approx(LR / 2)
    h = lr_schedule("CosineAnnealingWarmRestarts", LR, None, {"t_0": 4})
    assert h(6) == approx(LR / 2) and h(8) == approx(LR)


def test_total_steps_option_overrides_training_steps() -> None:
    f = lr_schedule("LinearWithWarmUpLR", LR, 50, {"total_steps": 100})
    assert f(50) == approx(LR / 2)
    g = lr_schedule("LinearWithWarmUpLR", LR, 50, {"total_steps": -1})  # -1: training.steps
    assert g(25) == approx(LR / 2)


@pytest.mark.parametrize(
    ("type_", "total", "options", "fragment"),
    [
        (
            "LinearWithWarmUpLR",
            10,
            {"warmup_steps": 20},
            "lr_scheduler.warmup_steps: the warm-up (20 steps) is longer",
        ),
        (
            "CosineWithWarmUpLR",
            100,
            {"warmup_steps": 20, "decay_steps": 10},
            "longer than lr_scheduler.decay_steps",
        ),
        (
            "WarmUpStableDecayLR",
            100,
            {"warmup_steps": 20, "decay_start_steps": 10},
            "lr_scheduler.decay_start_steps",
        ),
        ("WarmUpStableDecayLR", 100, {"decay_start_steps": 200}, "between the end of the warm-up"),
        (
            "CosineWithWarmUpLR",
            100,
            {"min_lr": 0.1},
            "lr_scheduler.min_lr: the final learning rate (0.1) is above",
        ),
        ("CosineWithWarmUpLR", 100, {"min_lr": 0, "lr_end": 0}, "lr_scheduler.min_lr: conflicts with lr_end"),
        (
            "WarmUpStableDecayLR",
            100,
            {"decay_ratio": 0.1, "decay_start_ratio": 0.5},
            "conflicts with decay_start_ratio",
        ),
        ("CosineWithWarmUpLR", None, {}, "lr_scheduler: CosineWithWarmUpLR needs the total number of steps"),
        ("CosineWithWarmUpLR", 100, {"warmup_step": 3}, "lr_scheduler.warmup_step: unknown key"),
        ("CosineWithWarmUpLR", 100, {"warmup_steps": -1}, "lr_scheduler.warmup_steps: must be in [0, inf]"),
        ("CosineWithWarmUpLR", 100, {"warmup_ratio": 1.5}, "lr_scheduler.warmup_ratio: must be in [0, 1]"),
        ("CosineWithWarmUpLR", 100, {"warmup_steps": True}, "expected a number, got the bool True"),
        ("CosineWithWarmUpLR", 100, {"warmup_steps": 2.5}, "expected an integer"),
        ("CosineWithWarmUpLR", 100, {"num_cycles": 0}, "lr_scheduler.num_cycles: must be in (0, inf]"),
        ("CosineLR", 100, {}, "lr_scheduler.type: unknown lr_scheduler type 'CosineLR'"),
        ("ConstantWithCoolDownLR", None, {}, "lr_scheduler: ConstantWithCoolDownLR needs the total number"),
        (
            "CosineAnnealingLR",
            100,
            {},
            "lr_scheduler.t_max: required for lr_scheduler type CosineAnnealingLR",
        ),
        ("CosineAnnealingWarmRestarts", 100, {"t_0": None}, "lr_scheduler.t_0: required"),
        ("PolynomialWithWarmUpLR", 100, {"power": 0}, "lr_scheduler.power: must be in (0, inf]"),
    ],
)
def test_schedule_errors_name_the_key(type_: str, total, options: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        lr_schedule(type_, LR, total, options)
    assert fragment in str(err.value)


def test_numbers_from_yaml_strings() -> None:
    # PyYAML reads 1e-5 as a string; "10" is accepted for an int.
    f = lr_schedule("CosineWithWarmUpLR", LR, 110, {"warmup_steps": "10", "lr_end": "1e-5"})
    assert f(10) == approx(LR) and f(110) == approx(1e-5)


def test_check_scheduler_options() -> None:
    assert check_scheduler_options("ConstantWarmUpLR", {"warmup_ratio": 0}) == []
    assert check_scheduler_options("constantwarmuplr", {"warmup_steps": 3}) == []  # case-insensitive type
    problems = check_scheduler_options("CosineWithWarmUpLR", {"min_lrr": 0.1, "lr_end": "x"})
    assert problems[0][0] == "min_lrr" and "did you mean 'min_lr'?" in problems[0][1]
    assert problems[1] == ("lr_end", "expected a number, got 'x'")
    assert check_scheduler_options("CosineWithWarmUp", {})[0][1].endswith(
        "did you mean 'CosineWithWarmUpLR'?"
    )
    assert check_scheduler_options(None, {}) == []
    assert check_scheduler_options("ConstantWithCoolDownLR", {"keep_steps": 3}) == []
    assert check_scheduler_options("ConstantWithCoolDownLR", {"keep_step": 3})[0][1].startswith(
        "unknown key for lr_scheduler type ConstantWithCoolDownLR; did you mean 'keep_steps'?"
    )
    assert scheduler_not_built("ConstantWithCoolDownLR") is None
    assert scheduler_not_built("WarmUpStableDecayLR") is None and scheduler_not_built(None) is None


# ----------------------------------------------------------------------------- torch scheduler


def _optimizer(lr: float = LR):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [p]}, {"params": [], "weight_decay": 0.0}], lr=lr)


def _run(opt, sched, steps: int) -> list[float]:
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used


OPTS = {"warmup_steps": 3, "decay_start_steps": 6, "lr_end": 0.0}


def test_scheduler_uses_lr_at_k_minus_1_for_step_k() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler(
        opt, type="WarmUpStableDecayLR", learning_rate=LR, total_steps=10, options=OPTS
    )
    f = lr_schedule("WarmUpStableDecayLR", LR, 10, OPTS)
    used = _run(opt, sched, 12)
    assert used == [f(k - 1) for k in range(1, 13)]
    assert sched.last_epoch == 12
    assert all(g["lr"] == f(12) for g in opt.param_groups)


def test_scheduler_state_dict_round_trip() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler(
        opt, type="WarmUpStableDecayLR", learning_rate=LR, total_steps=10, options=OPTS
    )
    _run(opt, sched, 4)
    state = sched.state_dict()
    assert "lr_fn" not in state and state["last_epoch"] == 4
    assert json.loads(json.dumps(state)) == state  # plain numbers: fits trainer_state.json
    rest = _run(opt, sched, 5)
    # A fresh optimizer (as with no_load_optim) and scheduler restored from the state continue exactly.
    opt2 = _optimizer()
    sched2 = build_lr_scheduler(
        opt2, type="WarmUpStableDecayLR", learning_rate=LR, total_steps=10, options=OPTS
    )
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == lr_schedule("WarmUpStableDecayLR", LR, 10, OPTS)(4)
    assert _run(opt2, sched2, 5) == rest
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_scheduler_with_zero_learning_rate() -> None:
    opt = _optimizer(lr=0.0)
    sched = build_lr_scheduler(
        opt, type="ConstantWarmUpLR", learning_rate=0.0, total_steps=None, options={"warmup_steps": 2}
    )
    assert _run(opt, sched, 3) == [0.0, 0.0, 0.0]


def test_options_are_typed_and_declared_once() -> None:
    import dataclasses

    from meshforge.optim.options import SCHEDULER_OPTIONS, CosineWithWarmUpLROptions
    from meshforge.optim.specs import SCHEDULER_SPECS, resolve_scheduler_options

    canon, opts = resolve_scheduler_options(
        "cosinewithwarmuplr", {"min_lr": "1e-5", "warmup_steps": "3", "decay_ratio": 0.5}
    )
    assert canon == "CosineWithWarmUpLR" and isinstance(opts, CosineWithWarmUpLROptions)
    assert (opts.lr_end, opts.warmup_steps, opts.decay_ratio, opts.num_cycles) == (1e-5, 3, 0.5, 0.5)
    assert opts.decay_steps is None and opts.warmup_ratio is None
    # The table of keys is the dataclass fields plus their aliases, nothing written twice.
    for name, cls in SCHEDULER_OPTIONS.items():
        table = SCHEDULER_SPECS[name]
        fields = [f.name for f in dataclasses.fields(cls)]
        assert [k for k, spec in table.items() if spec.alias_of is None] == fields
        assert all(table[spec.alias_of] for spec in table.values() if spec.alias_of is not None)
