"""meshforge.config: the typed, validated YAML configuration of a run (light: never imports torch).

`load_config` reads a native or MindSpeed-LLM YAML file, applies `--section.key=value` overrides
and returns a frozen `TrainConfig`; `check_trainable` refuses what the run cannot do yet.
"""

from meshforge.config.base import ConfigError
from meshforge.config.checks import Report, check_trainable, validate_config
from meshforge.config.dump import dump_config
from meshforge.config.loader import config_from_dict, load_config
from meshforge.config.root import TrainConfig
from meshforge.config.unsupported import unsupported_features

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
