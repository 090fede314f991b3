"""`meshforge plot RUN_DIR [RUN_DIR ...] [-o FILE]`: the curves of one or more runs in one PNG.

Four panels against the step: loss (eval loss dashed, and with per-dataset evaluation each
dataset's `eval_loss/<name>` in thinner dash patterns of the run's colour; a preference run's
`rewards/margins` dotted on a second axis), learning rate, gradient norm and tokens/s, one colour per run. Read from each run's `metrics.jsonl`; a skipped step's null values leave a
gap. Drawn with matplotlib's headless Agg backend, so it works on a machine without a display.
`plot_loss` draws LLaMA-Factory's `training_loss.png` (`monitor.plot_loss`) from the same records.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PANELS = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"),
)


class PlotError(ValueError):
    """A run folder without readable metrics, or matplotlib missing: one line for the user."""


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (PlotError naming the file when it cannot be used)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (give a run's training.output_dir)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{path}:{number}: not a JSON object ({err.msg})") from err
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise PlotError(f"{path}: no step records yet")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        if key not in record:
            continue
        value = record[key]
        steps.append(int(record["step"]))
        values.append(float(value) if isinstance(value, int | float) and math.isfinite(value) else math.nan)
    return steps, values


# Dash patterns of the per-dataset eval curves, in turn (the overall eval loss is "--o").
DATASET_DASHES = ((0, (4, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)), (0, (2, 3)))


def eval_curves(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(metrics key, legend suffix) of every eval curve in `records`: the overall one, then each dataset's."""
    names = dict.fromkeys(
        key.removeprefix("eval_loss/") for record in records for key in record if key.startswith("eval_loss/")
    )
    return [("eval_loss", "eval")] + [(f"eval_loss/{name}", f"eval {name}") for name in names]


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """Draw `run_dirs` into `out` (PNG); returns `out`."""
    runs = [read_run(run_dir) for run_dir in run_dirs]
    try:
        import matplotlib
    except ImportError as err:
        raise PlotError(
            "meshforge plot needs matplotlib, a dependency of meshforge: reinstall it (pip install meshforge)"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    labels = _labels(run_dirs)
    for records, label, colour in zip(runs, labels, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 9):
        for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
            steps, values = _series(records, key)
            ax.plot(steps, values, color=colour, label=label, linewidth=1.2)
            if key == "loss":
                _plot_eval(ax, records, label, colour)
                plot_margin(ax, records, label, colour)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def smooth(values: list[float]) -> list[float]:
    """LLaMA-Factory's curve smoothing: TensorBoard's EMA with a weight that grows with the length."""
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    last, out = values[0], []
    for value in values:
        last = last * weight + (1 - weight) * value
        out.append(last)
    return out


def plot_loss(run_dir: Path, out: Path | None = None) -> Path:
    """LLaMA-Factory's `plot_loss` picture: the run's loss and its smoothed curve, in
    `run_dir/training_loss.png` (or `out`)."""
    steps, losses = _series(read_run(run_dir), "loss")
    kept = [(s, v) for s, v in zip(steps, losses, strict=True) if math.isfinite(v)]
    if not kept:
        raise PlotError(f"{run_dir / 'metrics.jsonl'}: no finite loss to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    xs, ys = [s for s, _ in kept], [v for _, v in kept]
    plt.plot(xs, ys, color="#1f77b4", alpha=0.4, label="original")
    plt.plot(xs, smooth(ys), color="#1f77b4", label="smoothed")
    plt.title(f"training loss of {run_dir}")
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    target = out or run_dir / "training_loss.png"
    fig.savefig(target, format="png", dpi=100)
    plt.close(fig)
    return target


def _plot_eval(ax: Any, records: list[dict[str, Any]], label: str, colour: str) -> None:
    """The run's eval losses on the loss panel (nothing for a run without evaluation)."""
    for i, (key, suffix) in enumerate(eval_curves(records)):
        steps, values = _series(records, key)
        if not steps:
            continue
        if i == 0:
            ax.plot(steps, values, "--o", color=colour, markersize=3, label=f"{label} ({suffix})")
        else:
            dashes = DATASET_DASHES[(i - 1) % len(DATASET_DASHES)]
            ax.plot(steps, values, linestyle=dashes, color=colour, linewidth=0.9, label=f"{label} ({suffix})")


def plot_margin(ax: Any, records: list[dict[str, Any]], label: str, colour: str) -> Any:
    """A preference run's reward margin, dotted, on a second y axis of the loss panel (or None)."""
    steps, values = _series(records, "rewards/margins")
    if not steps:
        return None
    twin = ax.twinx()
    twin.plot(steps, values, color=colour, linestyle=":", linewidth=1.2, label=f"{label} reward margin")
    twin.set_ylabel("reward margin (dotted)")
    return twin


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name, with its parent's when two names collide."""
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in run_dirs]


def run_plot_command(run_dirs: list[str], output: str | None) -> int:
    """The `meshforge plot` command: default output `RUN_DIR/metrics.png` for one run, else `./metrics.png`."""
    import sys

    dirs = [Path(d) for d in run_dirs]
    out = Path(output) if output else (dirs[0] / "metrics.png" if len(dirs) == 1 else Path("metrics.png"))
    try:
        written = plot_runs(dirs, out)
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0
