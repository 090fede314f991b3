"""The resolved config as YAML: every field with its value (defaults filled) and passthrough keys.

Written into each run's output folder and printed by `meshforge config show`; it loads back to an
equal TrainConfig.
"""

from __future__ import annotations

from meshforge.config.loader import dump_yaml
from meshforge.config.root import TrainConfig


def dump_config(cfg: TrainConfig) -> str:
    """Resolved YAML of `cfg`, sections in reference order, passthrough keys included."""
    return dump_yaml(cfg.model_dump(mode="json"))
