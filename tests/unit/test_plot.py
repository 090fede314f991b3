"""`meshforge plot`: several runs overlaid into one PNG (headless), and errors that name the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.cli.main import main


def _run(
    folder: Path, steps: int, scale: float, *, skipped: int | None = None, per_dataset: bool = False
) -> Path:
    folder.mkdir(parents=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            record = {
                "step": step,
                "loss": scale * 9 / step,
                "lr": 1e-3,
                "grad_norm": 1.0 / step,
                "tokens_per_s": 900.0,
            }
            if step == skipped:
                record.update(loss=None, grad_norm=None, skipped=True)
            if step % 5 == 0:
                record["eval_loss"] = scale * 10 / step
                if per_dataset:
                    record.update({"eval_loss/a": scale * 8 / step, "eval_loss/b": scale * 12 / step})
            f.write(json.dumps(record) + "\n")
    return folder


@pytest.mark.procs  # matplotlib may start a process (its font cache) on first use
def test_two_runs_are_drawn_into_one_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = pytest.importorskip("matplotlib.image")
    a = _run(tmp_path / "a", 20, 1.0, skipped=7)
    b = _run(tmp_path / "b", 12, 1.3, per_dataset=True)
    out = tmp_path / "figs" / "curves.png"
    assert main(["plot", str(a), str(b), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(out)
    assert pixels.shape[:2] == (770, 1210)  # 11 x 7 inches at 110 dpi
    assert pixels[..., :3].std() > 0.05  # something was drawn
    # One run: the PNG goes into its folder by default.
    assert main(["plot", str(a)]) == 0
    assert (a / "metrics.png").is_file()


def test_plot_errors_name_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'nowhere'}: no metrics.jsonl (give a run's training.output_dir)"
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{oops\n')
    assert main(["plot", str(bad)]) == 2
    assert f"{bad / 'metrics.jsonl'}:2: not a JSON object" in capsys.readouterr().err


def test_eval_curves_name_each_dataset(tmp_path: Path) -> None:
    from meshforge.monitor.plot import eval_curves, read_run

    assert eval_curves(read_run(_run(tmp_path / "a", 10, 1.0))) == [("eval_loss", "eval")]
    assert eval_curves(read_run(_run(tmp_path / "b", 10, 1.0, per_dataset=True))) == [
        ("eval_loss", "eval"),
        ("eval_loss/a", "eval a"),
        ("eval_loss/b", "eval b"),
    ]
