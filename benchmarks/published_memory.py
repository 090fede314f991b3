"""The per-device memory model against published peak memory: predicted / published.

Every run of the `memory` group of `published_runs.yaml` is planned by `predict_device_peak`
(`src/meshforge/parallel/device_peak.py`) with the published layout as overrides of a shipped
example and the model's published config.json (edited by `model_changes` where the model has no
folder here). One JSON line per run, then the spread of published / predicted allocated bytes.

    PYTHONPATH=src .venv/bin/python benchmarks/published_memory.py      # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _harness import emit

from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import predict_device_peak

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).with_name("published_runs.yaml")
_GIB = 1024**3


def predict(run: dict[str, Any], folder: Path, index: int) -> dict[str, Any]:
    model_dir = folder / f"model{index}"
    model_dir.mkdir()
    config = json.loads((ROOT / run["model_config"]).read_text(encoding="utf-8"))
    config.update(run.get("model_changes") or {})
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    overrides = [*run["overrides"], f"--model.model_name_or_path={model_dir}"]
    cfg = load_config(str(ROOT / run["config"]), overrides, log=lambda _: None)
    peak = predict_device_peak(cfg, int(run["world_size"]))
    published = float(run["memory_gib"])
    return {
        "run": run["name"],
        "published_gib": published,
        "predicted_allocated_gib": round(peak.allocated / _GIB, 2),
        "ratio_published_over_predicted": round(published * _GIB / peak.allocated, 3),
        "phase": peak.phase,
        "stage": peak.stage,
        "components_gib": {k: round(v / _GIB, 2) for k, v in peak.components().items()},
    }


def main() -> None:
    runs = yaml.safe_load(RUNS.read_text(encoding="utf-8"))["memory"]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, run in enumerate(runs):
            record = predict(run, Path(tmp), index)
            ratios.append(record["ratio_published_over_predicted"])
            emit(record)
    emit({"runs": len(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})


if __name__ == "__main__":
    main()
