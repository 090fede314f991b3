"""JSON schema of the native config, for editor completion and validation of YAML files.

Point the YAML language server at it (`# yaml-language-server: $schema=meshforge.schema.json`).
Passthrough sections allow additional properties; every other section forbids them.
"""

from __future__ import annotations

import json

from meshforge.config.root import TrainConfig


def config_schema() -> dict[str, object]:
    """The JSON schema (draft 2020-12) of TrainConfig, with a one-line description per field."""
    schema = TrainConfig.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "meshforge training config"
    schema.setdefault("description", "One YAML file describing a meshforge training run.")
    return schema


def schema_json() -> str:
    """`config_schema()` as indented JSON text."""
    return json.dumps(config_schema(), indent=2, sort_keys=False) + "\n"
