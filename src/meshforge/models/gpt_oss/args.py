"""Structural hyper-parameters of the built-in gpt-oss family and its named flavors.

``GptOssArgs`` mirrors transformers' ``GptOssConfig`` (5.24) field for field, same
names and defaults, so a ``config.json`` or the ``model:`` passthrough keys of a
YAML map onto it one to one. Derived values are resolved the way ``GptOssConfig``
resolves them: ``head_dim`` None means hidden / heads, ``layer_types`` None means
sliding attention on even layers (0, 2, ...) and full attention on odd ones, and
``rope_parameters`` None means gpt-oss' YaRN (factor 32 over 4096 positions,
``beta_fast`` 32, ``beta_slow`` 1, no truncation) with base 150000. Spellings from
older files are accepted too: ``num_experts`` for ``num_local_experts``,
``rope_scaling`` for ``rope_parameters`` and a top-level ``rope_theta``.

``hidden_act`` is kept for config round trips only: like transformers, the
experts always apply gpt-oss' clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).
This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import as_float, positive_int, require_positive

DEFAULT_ROPE_THETA = 150_000.0
#: RoPE types the built-in model computes (transformers' ``rope_type``).
ROPE_TYPES: tuple[str, ...] = ("default", "yarn")
LAYER_TYPES: tuple[str, ...] = ("sliding_attention", "full_attention")
#: gpt-oss' YaRN parameters, what ``GptOssConfig`` fills in when ``rope_parameters`` is None.
DEFAULT_YARN: dict[str, object] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


# Other spellings found in config.json files and older configs.
ALIASES: dict[str, str] = {"num_experts": "num_local_experts", "rope_scaling": "rope_parameters"}


@dataclass(frozen=True)
class GptOssArgs(FamilyArgs):
    """gpt-oss decoder configuration (names and defaults of ``transformers.GptOssConfig``)."""

    label: ClassVar[str] = "gpt-oss"
    aliases: ClassVar[Mapping[str, str]] = ALIASES
    lenient_aliases: ClassVar[bool] = True

    num_hidden_layers: int = 36
    num_local_experts: int = 128
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    head_dim: int | None = 64
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    sliding_window: int | None = 128
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_parameters: dict[str, object] | None = None
    rope_theta: float | None = None
    attention_dropout: float = 0.0
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    use_cache: bool = True
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    attention_bias: bool = True

    def __post_init__(self) -> None:
        kv_heads = self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads
        object.__setattr__(self, "num_key_value_heads", kv_heads)
        require_positive(
            self,
            (
                "num_hidden_layers",
                "num_local_experts",
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "num_experts_per_tok",
            ),
        )
        if self.head_dim is not None:
            positive_int("head_dim", self.head_dim)
        if self.attn_head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.attn_head_dim}")
        rules.check_kv_heads(self.num_attention_heads, kv_heads)
        rules.check_attention_dropout(self.attention_dropout)
        rules.check_routing(
            self.num_experts_per_tok,
            self.num_local_experts,
            experts_key="num_local_experts",
            aux_loss_coef=self.router_aux_loss_coef,
        )
        if float(self.swiglu_limit) <= 0:
            raise ValueError(f"swiglu_limit: must be > 0, got {self.swiglu_limit!r}")
        types = self.resolved_layer_types
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: needs one entry per layer ({self.num_hidden_layers}), got {len(types)}"
            )
        for i, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]: must be one of {list(LAYER_TYPES)}, got {kind!r}")
        if "sliding_attention" in types:
            if self.sliding_window is None:
                raise ValueError(
                    "sliding_window: required (a positive integer) when layer_types has sliding_attention"
                )
            positive_int("sliding_window", self.sliding_window)
        if self.rope_parameters is not None and not isinstance(self.rope_parameters, dict):
            raise ValueError(f"rope_parameters: must be a mapping, got {self.rope_parameters!r}")
        rope_type = self.rope["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters.rope_type: not supported yet: rope_type {rope_type} (built: {', '.join(ROPE_TYPES)})"
            )
        partial = self.rope.get("partial_rotary_factor", 1.0)
        if partial is not None and as_float(partial) != 1.0:
            raise ValueError(
                f"rope_parameters.partial_rotary_factor: not supported yet: {partial} (only 1.0)"
            )

    @property
    def attn_head_dim(self) -> int:
        """Per-head size: ``head_dim`` if set, else ``hidden_size // num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def resolved_layer_types(self) -> list[str]:
        """``layer_types``, or transformers' default: sliding on even layers, full on odd ones."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)
        ]

    @property
    def rope(self) -> dict[str, object]:
        """The complete ``rope_parameters`` transformers ends up with (type, base and type keys)."""
        params = dict(DEFAULT_YARN if self.rope_parameters is None else self.rope_parameters)
        params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
        if params.get("rope_theta") is None:
            params["rope_theta"] = float(
                self.rope_theta if self.rope_theta is not None else DEFAULT_ROPE_THETA
            )
        if params["rope_type"] == "yarn":
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return params

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.GptOssConfig`` that describe the same model."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_theta"}
        out["head_dim"] = self.attn_head_dim
        out["layer_types"] = self.resolved_layer_types
        out["rope_parameters"] = self.rope
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, GptOssArgs]:
        return FLAVORS

    @classmethod
    def coerce_option(cls, key: str, value: object) -> object:
        """Accept YAML spellings of numbers (``"1e-5"``); never a bool as a number."""
        if key == "layer_types" and value is not None:
            if not isinstance(value, list | tuple):
                raise ValueError(f"layer_types: must be a list of {list(LAYER_TYPES)}, got {value!r}")
            return list(value)
        if key == "rope_parameters" and value is not None:
            if not isinstance(value, dict):
                raise ValueError(f"rope_parameters: must be a mapping, got {value!r}")
            return dict(value)
        return super().coerce_option(key, value)


OPTION_KEYS: frozenset[str] = GptOssArgs.option_keys()

FLAVORS: dict[str, GptOssArgs] = {
    # The demo model: 8 experts, top-2, sliding (window 64) and full layers alternating, gpt-oss'
    # default YaRN rope; CPU-sized.
    "tiny": GptOssArgs(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=256,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    ),
    # For unit and distributed tests.
    "debug": GptOssArgs(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        output_router_logits=True,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``GptOssArgs``.
from_options = GptOssArgs.from_options
