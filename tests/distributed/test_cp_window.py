"""``kernels.pre_tokens`` under context parallelism equals one process (gloo).

The window reaches the CP plan as a sliding window in global positions (the narrower of the
layer's own window and ``pre_tokens + 1``). One 2-process launch compares, for every method
that runs on 2 ranks (ulysses, colossal with the fused CPU kernel and on its plain autograd
path, kvallgather), the full-order logits, the loss and every gradient with those of one
process with the same weights and window: a tiny Qwen3 (plain and packed rows), gpt_oss with
sinks and a sliding layer of window 5 against ``pre_tokens`` 2 (the band is narrower) and 6
(the layer's window is), and MLA. A 4-process launch checks hybrid (ulysses 2 x ring 2), and
`meshforge train --kernels.pre_tokens=3` gives the 1-process losses and grad norms with cp2
(ulysses, colossal), which differ from those without the window.
Documents are cut across the rank chunks, and a window of 3 crosses every chunk boundary of
the 16-token rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers
from tests.distributed.test_cp import _args as _qwen3_args
from tests.distributed.test_cp_families import _check_equal, _deepseek, _gpt_oss, _plain_ring

pytestmark = pytest.mark.slow


def _windowed(build: Callable[[], nn.Module], pre_tokens: int) -> Callable[[], nn.Module]:
    """``build`` with the window switched on as a run does (``configure_kernels``)."""
    from meshforge.models.common.kernels import KernelOptions

    def make() -> nn.Module:
        model = build()
        model.configure_kernels(KernelOptions(pre_tokens=pre_tokens))
        return model

    return make


def _qwen3() -> nn.Module:
    from meshforge.models.qwen3.model import build_qwen3

    return build_qwen3(_qwen3_args(), device="cpu")


def _unwindowed_differs(mesh) -> None:
    """The one-process reference itself changes with the window (so the CP checks can fail)."""
    from tests.distributed.test_cp_families import _batch

    batch = _batch(True)
    torch.manual_seed(0)
    plain = _qwen3()
    windowed = _windowed(_qwen3, 3)()
    windowed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a = plain(batch["input_ids"], None, batch["segment_ids"])
        b = windowed(batch["input_ids"], None, batch["segment_ids"])
    assert (a - b).norm() > 1e-3 * a.norm()


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    models = {
        "qwen3_pre3": _windowed(_qwen3, 3),
        "gpt_oss_pre2": _windowed(_gpt_oss(), 2),
        "gpt_oss_pre6": _windowed(_gpt_oss(), 6),
        "deepseek_pre3": _windowed(_deepseek(8, 8), 3),
    }
    if world == 2:
        _unwindowed_differs(mesh)
        for name, build in models.items():
            for method in ("ulysses", "colossal", "kvallgather"):
                _check_equal(name, build, method, mesh, packed=True)
        for method in ("ulysses", "colossal", "kvallgather"):
            _check_equal("qwen3_pre3", models["qwen3_pre3"], method, mesh, packed=False)
        with _plain_ring():
            for name in ("qwen3_pre3", "gpt_oss_pre2"):
                _check_equal(name, models[name], "colossal", mesh, packed=True)
    else:
        for name in ("qwen3_pre3", "gpt_oss_pre2"):
            _check_equal(name, models[name], "hybrid", mesh, packed=True)
        _check_equal("qwen3_pre3", models["qwen3_pre3"], "hybrid", mesh, packed=False)


def test_cp_window_two_ranks_equal_one_process() -> None:
    run_workers(_worker, 2)


def test_cp_window_four_ranks_hybrid_equal_one_process() -> None:
    run_workers(_worker, 4)


def test_train_with_the_window_under_cp_equals_one_process(tiny_config: Path, tmp_path: Path) -> None:
    common = ["--training.steps=2", "--checkpoint.enable_save=false"]
    window = ["--kernels.pre_tokens=3"]
    runs = [
        Run(tiny_config, [*common, *window, f"--training.output_dir={tmp_path / 'one'}"]),
        Run(tiny_config, [*common, f"--training.output_dir={tmp_path / 'full'}"]),
    ]
    for method in ("ulysses", "colossal"):
        cp = ["--parallelism.context_parallel=2", f"--parallelism.context_parallel_method={method}"]
        overrides = [*common, *window, *cp, f"--training.output_dir={tmp_path / method}"]
        runs.append(Run(tiny_config, overrides, 2, log=tmp_path / f"{method}.log"))
    train_all(runs)
    one, full = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "full")
    assert len(one) == 2 and one[0]["loss"] != pytest.approx(full[0]["loss"], rel=1e-4)
    for method in ("ulysses", "colossal"):
        assert f"CP ({method}) over 2 ranks" in (tmp_path / f"{method}.log").read_text()
        for x, y in zip(one, read_metrics(tmp_path / method), strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), method
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), method
