"""The resolved config as YAML: every field with its value (defaults filled) and passthrough keys.

Written into each run's output folder and printed by `meshforge config show`; it loads back to an
equal TrainConfig.
"""

from __future__ import annotations

from meshforge.config.loader import dump_yaml
from meshforge.config.root import TrainConfig


def dump_config(cfg: TrainConfig) -> str:
    """Resolved YAML of `cfg`, sections in reference order, passthrough keys included.

    A tracker section (`monitor.wandb`, `monitor.swanlab`) switches its tracker on by being
    written, so one that is off is left out: the file runs the same trackers when loaded back
    (under `report_to: none` every section stays, since none of them is on).
    """
    data = cfg.model_dump(mode="json")
    monitor = data["monitor"]
    if cfg.monitor.report_to != "none":
        for name in ("wandb", "swanlab"):
            if name not in cfg.monitor.trackers():
                monitor.pop(name, None)
    return dump_yaml(data)
