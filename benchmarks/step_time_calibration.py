"""The step-time model against published runs: predicted / published tokens/s per device.

Every run of `published_runs.yaml` is planned as `meshforge config validate --device` plans it
(the same `predict_step`), with the published layout as overrides of a shipped example config and
the model's published config.json. One JSON line per run, then one summary line with the spread
of the calibration ratios (the model is fitted to those; `independent` runs, when listed, are
printed apart and never fitted to).

    .venv/bin/python benchmarks/step_time_calibration.py      # ~20 s on 2 cores
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _harness import emit

from meshforge.config.loader import load_config
from meshforge.parallel.step_time import predict_step
from meshforge.utils.hardware import hardware

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).with_name("published_runs.yaml")


def predict(run: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Plan one published run and compare its tokens/s per device."""
    model_dir = folder / Path(run["model_config"]).stem
    model_dir.mkdir(exist_ok=True)
    shutil.copy(ROOT / run["model_config"], model_dir / "config.json")
    overrides = [*run["overrides"], f"--model.model_name_or_path={model_dir}"]
    cfg = load_config(str(ROOT / run["config"]), overrides)
    seq = cfg.train_dataset.seq_length()
    if seq != run["seq"]:
        raise ValueError(f"{run['name']}: the overrides give sequence {seq}, the published run {run['seq']}")
    hw = hardware(run["device"])
    p = predict_step(cfg, int(run["world_size"]), hw)
    return {
        "run": run["name"],
        "predicted_tokens_per_s": round(p.tokens_per_device, 1),
        "published_tokens_per_s": run["tokens_per_s"],
        "ratio": round(p.tokens_per_device / float(run["tokens_per_s"]), 3),
        "step_s": round(p.step, 3),
        "compute_s": round(p.compute, 3),
        "exposed_comm_s": round(p.exposed_comm, 3),
        "bubble_s": round(p.bubble, 3),
        "optimizer_s": round(p.optimizer, 4),
        "mfu": round(p.mfu, 3),
        "bound_by": p.bottleneck(),
    }


def main() -> None:
    runs = yaml.safe_load(RUNS.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        for group in ("calibration", "other_dispatcher", "independent"):
            ratios = []
            for run in runs.get(group) or []:
                record = predict(run, Path(tmp))
                ratios.append(record["ratio"])
                emit({"group": group, **record})
            if ratios:
                emit(
                    {
                        "group": group,
                        "runs": len(ratios),
                        "ratio_min": min(ratios),
                        "ratio_max": max(ratios),
                        "within_0.75_1.33": all(0.75 <= r <= 1.33 for r in ratios),
                    }
                )


if __name__ == "__main__":
    main()
