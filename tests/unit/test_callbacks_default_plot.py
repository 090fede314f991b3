"""The end-of-run plot every run draws by default (`monitor.plot_curves`), and its off switches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshforge.config import config_from_dict
from meshforge.monitor.config import MonitorConfig
from meshforge.train.callbacks import CallbackConfig, PlotCurves, builtin_callbacks
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)


def _monitor(**section: object) -> MonitorConfig:
    base = {
        "model": {"model_type": "qwen3"},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
        "monitor": section,
    }
    return config_from_dict(base).monitor


def test_the_plot_is_on_by_default_and_each_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    warnings: list[str] = []
    monkeypatch.delenv("MESHFORGE_PLOT", raising=False)
    (plot,) = builtin_callbacks(_monitor(), [], warn=warnings.append)
    assert isinstance(plot, PlotCurves)
    assert builtin_callbacks(_monitor(plot_curves=False), [], warn=warnings.append) == []
    # A PlotCurves of the user's own draws it instead (once, where the user said).
    assert builtin_callbacks(_monitor(), [CallbackConfig(type="PlotCurves")], warn=warnings.append) == []
    monkeypatch.setenv("MESHFORGE_PLOT", "0")
    assert builtin_callbacks(_monitor(), [], warn=warnings.append) == []
    assert warnings == []


def test_without_matplotlib_the_run_goes_on_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHFORGE_PLOT", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    warnings: list[str] = []
    assert builtin_callbacks(_monitor(), [], warn=warnings.append) == []
    assert warnings == [
        "warning: monitor.plot_curves: no end-of-run plot, matplotlib is not installed "
        "(matplotlib is a dependency of meshforge: reinstall it (pip install meshforge))"
    ]


def test_matplotlib_is_a_core_dependency() -> None:
    """A plain `pip install meshforge` run draws metrics.png: matplotlib is not behind an extra."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(dep.split("==")[0].strip() == "matplotlib" for dep in project["dependencies"])


@pytest.mark.procs  # matplotlib may start a process (its font cache) on first use
@pytest.mark.usefixtures("leave_no_process_group")
def test_a_run_ends_with_its_plot(tiny_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = pytest.importorskip("matplotlib.image")
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    monkeypatch.delenv("MESHFORGE_PLOT", raising=False)
    out = tiny_config.parent / "plotted"
    cfg = load_config(str(tiny_config), [f"training.output_dir={out}", "training.steps=2"])
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    trainer.train()
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.imread(png)[..., :3].std() > 0.05  # something was drawn
