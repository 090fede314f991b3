"""`recompute:`, `recompute_comm:` and `swap:` sections: activation memory savings (light).

Shape rules that need no model are checked here (modes, required companions, select_module and
swap list shapes, layer-spec syntax and order); ranges against the model's layer count are checked
by `meshforge.config.rules` when `num_hidden_layers` is known.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from meshforge.config.base import AtLeastOne, Bool, StrictSection, describe, rule_error
from meshforge.config.layer_spec import LayerSpecList


def _check_select_module(value: object) -> object:
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"must be a mapping of module-path regex -> list of layer specs, got {type(value).__name__}"
        )
    for key, specs in value.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"keys must be non-blank module-path strings, got {key!r}")
        if not isinstance(specs, list | tuple):
            raise ValueError(f"[{key!r}] must be a list of layer specs such as ['0-3'], got {specs!r}")
    return value


class RecomputeConfig(StrictSection):
    """Activation checkpointing."""

    mode: Literal["None", "full", "select"] = describe(
        "None", "Recompute mode: 'None', 'full' (whole layers) or 'select'."
    )
    full_recompute_layer: LayerSpecList | None = describe(
        None, "Layers recomputed whole in full mode, e.g. ['0-3']."
    )
    select_module: dict[str, LayerSpecList] | None = describe(
        None, "Select mode: module-path regex -> layer specs, e.g. {attention: ['0-1']}."
    )
    exclude_op: list[str] | None = describe(
        None,
        "Operators whose outputs are kept, not recomputed, e.g. [matmul, sdpa]; 'matmul/2' keeps every second call.",
    )
    modules: list[str] | None = describe(
        None,
        "Module patterns recomputed whole in full mode (MindSpeed recompute_modules), e.g. ['model.layers.{*}'].",
    )

    _select = field_validator("select_module", mode="before")(
        classmethod(lambda cls, v: _check_select_module(v))
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: object) -> object:
        if value is None:
            raise ValueError(
                "must be one of 'None', 'full', 'select' (quote 'None' in YAML; null is not a mode)"
            )
        return value

    @field_validator("exclude_op")
    @classmethod
    def _ops(cls, value: list[str] | None) -> list[str] | None:
        for i, op in enumerate(value or []):
            if not op.strip():
                raise ValueError(f"item [{i}] is blank; list operator names")
        return value

    @model_validator(mode="after")
    def _companions(self) -> RecomputeConfig:
        if self.mode == "full" and not self.full_recompute_layer and not self.modules:
            raise rule_error(
                "full_recompute_layer",
                "recompute.mode 'full' requires a non-empty full_recompute_layer (e.g. ['0-3'])",
            )
        if self.mode == "select" and not self.select_module:
            raise rule_error(
                "select_module",
                "recompute.mode 'select' requires select_module (module regex -> layer specs)",
            )
        return self


class RecomputeCommConfig(StrictSection):
    """Selective recomputation of communication operators."""

    enable: Bool = describe(False, "Recompute the selected communication operators.")
    select_module: dict[str, LayerSpecList] | None = describe(
        None, "Communication-module regex -> layer specs; required when enable is true."
    )

    _select = field_validator("select_module", mode="before")(
        classmethod(lambda cls, v: _check_select_module(v))
    )

    @model_validator(mode="after")
    def _companions(self) -> RecomputeCommConfig:
        if self.enable and not self.select_module:
            raise rule_error("select_module", "recompute_comm.enable requires select_module")
        return self


class LayerSwapItem(StrictSection):
    """One whole-layer offload entry."""

    layers: LayerSpecList = describe(..., "Layers whose activations are offloaded, e.g. ['0-1'].")


class OpSwapItem(StrictSection):
    """One operator offload entry."""

    op_name: str = describe(..., "Operator/module name whose activations are offloaded.")
    layers: LayerSpecList = describe(..., "Layers where that operator is offloaded.")


class SwapConfig(StrictSection):
    """Activation offload to host memory."""

    enable: Bool = describe(False, "Offload activations to host memory and fetch them back in backward.")
    default_prefetch: AtLeastOne = describe(1, "Operators fetched ahead in backward; in [1, num_layers - 1].")
    layer_swap: list[LayerSwapItem] | None = describe(
        None, "Whole-layer offload entries: [{layers: ['0-1']}]."
    )
    op_swap: list[OpSwapItem] | None = describe(
        None, "Operator offload entries: [{op_name: attention, layers: ['0']}]."
    )
