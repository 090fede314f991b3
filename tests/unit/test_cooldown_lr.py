"""`ConstantWithCoolDownLR`: MindFormers' warm-up / hold / cosine cool-down / two-floor schedule,
checked against curves computed by hand from its definition."""

from __future__ import annotations

import math

import pytest

from meshforge.optim.schedulers import build_lr_scheduler, lr_schedule

T = "ConstantWithCoolDownLR"


def _close(x: float):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_mindformers_docstring_example() -> None:
    # The example in MindFormers' class docstring: 10 warm-up, 10 hold, 10 cool-down, 10 at
    # lr_end1, then lr_end2.
    opts = {"warmup_steps": 10, "keep_steps": 10, "decay_steps": 10, "final_steps": 10}
    f = lr_schedule(T, 0.005, None, {**opts, "lr_end1": 0.002, "lr_end2": 0.001})
    assert [f(t) for t in (1, 15, 25, 35, 45)] == [
        _close(0.0005),
        _close(0.005),
        _close(0.0035),
        _close(0.002),
        _close(0.001),
    ]


def test_whole_curve_by_hand() -> None:
    lr, init, end1, end2 = 1e-3, 1e-4, 2e-4, 5e-5
    W, K, D, F = 4, 3, 8, 2
    opts = {
        "warmup_steps": W,
        "warmup_lr_init": init,
        "keep_steps": K,
        "decay_steps": D,
        "final_steps": F,
        "lr_end1": end1,
        "lr_end2": end2,
    }
    f = lr_schedule(T, lr, 1000, opts)
    expected = [init + (lr - init) * t / W for t in range(W)]
    expected += [lr] * K
    expected += [end1 + (lr - end1) * 0.5 * (1 + math.cos(math.pi * i / D)) for i in range(D)]
    expected += [end1] * F + [end2] * 5
    assert [f(t) for t in range(len(expected))] == [_close(v) for v in expected]
    assert f(W + K + D // 2) == _close((lr + end1) / 2)  # the cosine's midpoint


def test_defaults_read_total_steps_and_lr_end2_follows_lr_end1() -> None:
    # decay_steps defaults to total_steps (MindFormers), lr_end1 to 0, lr_end2 to lr_end1.
    f = lr_schedule(T, 1.0, 20, {"keep_steps": 5})
    assert f(0) == 1.0 and f(4) == 1.0
    assert f(5 + 10) == _close(0.5) and f(5 + 20) == 0.0 and f(10_000) == 0.0
    # An explicit lr_end2 of 0 is 0; only null follows lr_end1.
    g = lr_schedule(T, 1.0, 10, {"lr_end1": 0.1, "lr_end2": 0.0, "final_steps": 2})
    assert g(10) == 0.1 and g(11) == 0.1 and g(12) == 0.0
    h = lr_schedule(T, 1.0, 10, {"lr_end1": 0.1, "lr_end2": None})
    assert h(500) == 0.1


def test_ratios_and_precedence() -> None:
    # int(50 * 0.1) = 5 warm-up steps, int(50 * 0.2) = 10 cool-down steps.
    f = lr_schedule(T, 1.0, 50, {"warmup_ratio": 0.1, "decay_ratio": 0.2})
    assert f(0) == 0.0 and f(5) == 1.0 and f(10) == _close(0.5) and f(15) == 0.0
    g = lr_schedule(T, 1.0, 50, {"decay_ratio": 0.2, "decay_steps": 4})  # decay_steps wins
    assert g(2) == _close(0.5) and g(4) == 0.0


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"lr_end1": 2.0}, "lr_scheduler.lr_end1: the learning rate after the cool-down (2) is above"),
        ({"keep_steps": -1}, "lr_scheduler.keep_steps: must be in [0, inf]"),
        ({"decay_steps": 0}, "lr_scheduler.decay_steps: must be in [1, inf]"),
        ({"final_steps": 1.5}, "lr_scheduler.final_steps: expected an integer"),
        ({"num_cycles": 0}, "lr_scheduler.num_cycles: must be in (0, inf]"),
        ({"lr_end3": 0.1}, "lr_scheduler.lr_end3: unknown key for lr_scheduler type ConstantWithCoolDownLR"),
    ],
)
def test_bad_options_name_the_key(options: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        lr_schedule(T, 1.0, 100, options)
    assert fragment in str(err.value)


def test_torch_scheduler_follows_the_curve() -> None:
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    opts = {"warmup_steps": 2, "keep_steps": 1, "decay_steps": 2, "lr_end1": 0.25}
    sched = build_lr_scheduler(opt, type=T, learning_rate=1.0, total_steps=10, options=opts)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [0.0, 0.5, 1.0, 1.0, _close(0.625), 0.25, 0.25]
