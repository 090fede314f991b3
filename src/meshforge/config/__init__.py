"""meshforge.config: the typed, validated YAML configuration of a run (light: never imports torch).

`load_config` reads a native or MindSpeed-LLM YAML file, applies `--section.key=value` overrides
and returns a frozen `TrainConfig`; `check_trainable` refuses what the run cannot do yet.

The names below are resolved lazily: section models beside their components import
`meshforge.config.base`, and an eager import of the root config here would make importing
e.g. `meshforge.parallel.config` first a circular import.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshforge.config.base import ConfigError
    from meshforge.config.checks import Report, check_trainable, validate_config
    from meshforge.config.dump import dump_config
    from meshforge.config.loader import config_from_dict, load_config
    from meshforge.config.root import TrainConfig
    from meshforge.config.unsupported import unsupported_features

_EXPORTS = {
    "ConfigError": "meshforge.config.base",
    "Report": "meshforge.config.checks",
    "check_trainable": "meshforge.config.checks",
    "validate_config": "meshforge.config.checks",
    "dump_config": "meshforge.config.dump",
    "config_from_dict": "meshforge.config.loader",
    "load_config": "meshforge.config.loader",
    "TrainConfig": "meshforge.config.root",
    "unsupported_features": "meshforge.config.unsupported",
}

__all__ = [
    "ConfigError",
    "Report",
    "TrainConfig",
    "check_trainable",
    "config_from_dict",
    "dump_config",
    "load_config",
    "unsupported_features",
    "validate_config",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshforge.config' has no attribute {name!r}")
