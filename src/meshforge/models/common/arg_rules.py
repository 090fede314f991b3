"""Rules that several families' ``*Args`` dataclasses share: RoPE fields and MoE routing options.

transformers 5.x moved the RoPE base and the rotated share of a head into ``rope_parameters``,
while published ``config.json`` files still spell them at the top level (``rope_theta``,
``partial_rotary_factor``, MiniMax-M2's ``rotary_dim``); each family reads both the same way.
The MoE option blocks of the Qwen3-MoE-like families (top-k at most the expert count, a
non-negative aux-loss coefficient, dense layers listed in ``mlp_only_layers``, a sparse layer
every ``decoder_sparse_step``) follow transformers' rules, written once here. The error texts
name the family's own field, so a message points at the key the user wrote. This module does
not import torch (``args.py`` files must load without it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshforge.models.common.options import as_float

#: Keys of a yarn ``rope_parameters`` dict: what ``meshforge.models.common.yarn`` reads (and
#: transformers writes). Here, not in ``yarn.py``, so that ``args.py`` files check them without torch.
YARN_KEYS: tuple[str, ...] = (
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "partial_rotary_factor",
)


def rope_base(
    rope_parameters: Mapping[str, object] | None, rope_theta: float | None, *, default: float
) -> float:
    """The RoPE base: ``rope_parameters.rope_theta``, else the top-level ``rope_theta``, else ``default``."""
    if rope_parameters and "rope_theta" in rope_parameters:
        return as_float(rope_parameters["rope_theta"])
    if rope_theta is not None:
        return float(rope_theta)
    return default


def rotary_share(rope_parameters: Mapping[str, object] | None, *, fallback: float) -> float:
    """Share of a head that is rotated: ``rope_parameters.partial_rotary_factor``, else ``fallback``.

    ``fallback`` is the family's older spelling (a top-level factor, ``rotary_dim / head_dim``)
    or its default when that is absent too.
    """
    if rope_parameters and rope_parameters.get("partial_rotary_factor") is not None:
        return as_float(rope_parameters["partial_rotary_factor"])
    return fallback


def check_default_rope(rope_parameters: object) -> None:
    """Refuse a ``rope_parameters`` that is not a mapping or asks for scaling (only ``default`` is built).

    Raises:
        ValueError: Naming ``rope_parameters`` or ``rope_parameters.rope_type``.
    """
    if rope_parameters is None:
        return
    if not isinstance(rope_parameters, dict):
        raise ValueError(f"rope_parameters: must be a mapping, got {rope_parameters!r}")
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type: not supported yet: {rope_type!r} (built: 'default')")


def check_kv_heads(num_attention_heads: int, num_key_value_heads: int) -> None:
    """Grouped-query attention needs the key/value head count to divide the query head count.

    Raises:
        ValueError: Naming ``num_key_value_heads``.
    """
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads: must divide num_attention_heads ({num_attention_heads}), "
            f"got {num_key_value_heads}"
        )


def check_attention_dropout(value: float) -> None:
    """``attention_dropout`` is a probability below 1.

    Raises:
        ValueError: Naming ``attention_dropout``.
    """
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"attention_dropout: must be in [0, 1), got {value!r}")


def check_routing(
    top_k: int,
    num_experts: int,
    *,
    top_k_key: str = "num_experts_per_tok",
    experts_key: str,
    aux_loss_coef: float | None = None,
) -> None:
    """A router picks at most every expert, and its load-balancing loss is not a reward.

    Args:
        top_k: Experts per token.
        num_experts: Routed experts per layer.
        top_k_key: The family's name of ``top_k``.
        experts_key: The family's name of ``num_experts`` (``num_local_experts``, ``moe_num_experts``).
        aux_loss_coef: ``router_aux_loss_coef``; None for a family without an aux loss.

    Raises:
        ValueError: Naming the key at fault.
    """
    if top_k > num_experts:
        raise ValueError(f"{top_k_key}: must be at most {experts_key} ({num_experts}), got {top_k}")
    if aux_loss_coef is not None and float(aux_loss_coef) < 0:
        raise ValueError(f"router_aux_loss_coef: must be >= 0, got {aux_loss_coef!r}")


def check_layer_indices(name: str, layers: object, num_hidden_layers: int) -> None:
    """``layers`` (e.g. ``mlp_only_layers``) is a list of decoder layer indices.

    Raises:
        ValueError: Naming ``name`` or the entry ``name[i]`` at fault.
    """
    if not isinstance(layers, list | tuple):
        raise ValueError(f"{name}: must be a list of layer indices, got {layers!r}")
    for i, layer in enumerate(layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_hidden_layers:
            raise ValueError(
                f"{name}[{i}]: must be a layer index in [0, {num_hidden_layers - 1}], got {layer!r}"
            )


def is_sparse_layer(
    layer: int, *, mlp_only_layers: Sequence[int], num_experts: int, decoder_sparse_step: int
) -> bool:
    """transformers' Qwen-MoE rule: sparse unless listed dense, with experts, every ``decoder_sparse_step``-th layer."""
    return layer not in mlp_only_layers and num_experts > 0 and (layer + 1) % decoder_sparse_step == 0
