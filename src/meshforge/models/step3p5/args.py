"""Structural hyper-parameters of the built-in Step-3.5 family (``model_type: step3p5``).

transformers 5.24 has no Step-3.5 model; the field names, defaults and per-layer rules here are
those of the published remote code (``configuration_step3p5.py`` / ``modeling_step3p5.py`` of
stepfun-ai/Step-3.5-Flash, the text decoder MindSpeed trains as ``step35``), so a published
``config.json`` maps onto ``Step3p5Args`` one to one. The model is heterogeneous by layer:

* ``layer_types[i]`` is ``full_attention`` or ``sliding_attention`` (without the list: sliding
  on even layers); sliding layers take their head counts from ``attention_other_setting``
  (``num_attention_heads``, ``num_attention_groups``) and see the last ``sliding_window`` keys;
* ``rope_theta`` and ``partial_rotary_factors`` may be per-layer lists; ``rope_scaling`` (a
  ``llama3`` dict in the published file) applies only to the layer types in ``yarn_only_types``
  (to every layer when that list is absent);
* ``moe_layers_enum`` (``"3,4,..."``) names the sparse layers (default: all but layer 0); the
  others have a dense MLP of ``intermediate_size``;
* ``swiglu_limits[i]`` clamps the routed experts' SwiGLU of layer i, ``swiglu_limits_shared[i]``
  the shared expert's and the dense MLP's (0 or null: no clamp).

Per-layer lists may be longer than ``num_hidden_layers``: the published file sizes them for
the decoder plus the ``num_nextn_predict_layers`` MTP layers, which the published modelling
code does not build (their checkpoint keys are ignored at load, as there). This module does
not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Self

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions, as_float, as_int, positive_int, require_positive

LAYER_KINDS = ("full_attention", "sliding_attention")
# config.json keys with the only value the published modelling code implements.
FIXED_KEYS: dict[str, object] = {
    "att_impl_type": "GQA",
    "use_qk_norm": True,
    "zero_centered": True,
    "sink": False,
}


ALIASES: dict[str, str] = {"share_expert_dims": "share_expert_dim"}


@dataclass(frozen=True)
class Step3p5Args(FamilyArgs):
    """Step-3.5 decoder configuration (names and defaults of the published ``Step3p5Config``)."""

    label: ClassVar[str] = "Step-3.5"
    aliases: ClassVar[Mapping[str, str]] = ALIASES
    extra_option_keys: ClassVar[frozenset[str]] = frozenset(FIXED_KEYS)

    vocab_size: int = 128815
    hidden_size: int = 4096
    intermediate_size: int = 11264
    num_attention_heads: int = 64
    num_attention_groups: int = 8
    num_hidden_layers: int = 45
    head_dim: int = 128
    max_position_embeddings: int = 128000
    rms_norm_eps: float = 1e-5
    moe_intermediate_size: int = 1280
    moe_num_experts: int = 288
    moe_top_k: int = 8
    moe_router_activation: str = "sigmoid"
    moe_router_scaling_factor: float = 1.0
    use_moe_router_bias: bool = True
    need_fp32_gate: bool = True
    norm_expert_weight: bool = True
    share_expert_dim: int = 1280
    moe_layers_enum: str | int | list[int] | None = None
    rope_theta: float | list[float] = 10000.0
    rope_scaling: dict[str, object] | None = None
    yarn_only_types: list[str] | None = None
    partial_rotary_factors: list[float] | None = None
    use_rope_layers: list[bool] | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    attention_other_setting: dict[str, object] | None = None
    use_head_wise_attn_gate: bool = False
    swiglu_limits: list[float | None] | None = None
    swiglu_limits_shared: list[float | None] | None = None
    num_nextn_predict_layers: int = 0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_attention_groups",
                "num_hidden_layers",
                "head_dim",
                "max_position_embeddings",
                "moe_intermediate_size",
                "moe_num_experts",
                "moe_top_k",
                "share_expert_dim",
            ),
        )
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers: must be >= 0, got {self.num_nextn_predict_layers}")
        rules.check_routing(
            self.moe_top_k, self.moe_num_experts, top_k_key="moe_top_k", experts_key="moe_num_experts"
        )
        if not (self.use_moe_router_bias or self.moe_router_activation == "sigmoid"):
            raise ValueError(
                f"moe_router_activation: not supported yet: {self.moe_router_activation!r} without "
                "use_moe_router_bias (built: sigmoid scores, with or without the router bias)"
            )
        if not self.norm_expert_weight:
            raise ValueError("norm_expert_weight: not supported yet: false (the published code renormalises)")
        self._check_lists()
        self._check_attention()

    def _per_layer(self, name: str, value: object) -> list[object] | None:
        if value is None:
            return None
        if not isinstance(value, list | tuple) or len(value) < self.num_hidden_layers:
            raise ValueError(
                f"{name}: must be a list with one entry per layer (at least num_hidden_layers = "
                f"{self.num_hidden_layers}), got {value!r}"
            )
        return list(value)

    def _check_lists(self) -> None:
        kinds = self._per_layer("layer_types", self.layer_types)
        for i, kind in enumerate(kinds or []):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_types[{i}]: must be one of {list(LAYER_KINDS)}, got {kind!r}")
        if isinstance(self.rope_theta, list | tuple):
            self._per_layer("rope_theta", self.rope_theta)
        for i in range(self.num_hidden_layers):
            if self.layer_theta(i) <= 0:
                raise ValueError(f"rope_theta: must be positive, got {self.layer_theta(i)} for layer {i}")
            dim = self.rotary_dim(i)
            if not 0 < dim <= self.head_dim or dim % 2:
                raise ValueError(
                    f"partial_rotary_factors[{i}]: head_dim ({self.head_dim}) x factor = {dim} rotated dims; "
                    "must be a positive even number at most head_dim"
                )
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            for i, limit in enumerate(self._per_layer(name, getattr(self, name)) or []):
                if limit is not None and (isinstance(limit, bool) or as_float(limit) < 0):
                    raise ValueError(f"{name}[{i}]: must be >= 0 or null, got {limit!r}")
        uses = self._per_layer("use_rope_layers", self.use_rope_layers or None)
        if uses is not None and not all(uses[: self.num_hidden_layers]):
            raise ValueError("use_rope_layers: not supported yet: a layer without RoPE")
        moe = self.moe_layers
        bad = [i for i in moe if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"moe_layers_enum: layer {bad[0]} is not in [0, {self.num_hidden_layers - 1}]")
        scaling = self.rope_scaling
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ValueError(f"rope_scaling: must be a mapping, got {scaling!r}")
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling.rope_type: not supported yet: {rope_type!r} (built: 'default', 'llama3')"
                )

    def _check_attention(self) -> None:
        for name, heads, groups in (
            ("", self.num_attention_heads, self.num_attention_groups),
            ("attention_other_setting.", *self.sliding_heads),
        ):
            positive_int(f"{name}num_attention_heads", heads)
            positive_int(f"{name}num_attention_groups", groups)
            if heads % groups:
                raise ValueError(
                    f"{name}num_attention_groups: must divide num_attention_heads ({heads}), got {groups}"
                )
        if self.sliding_window is not None:
            positive_int("sliding_window", self.sliding_window)

    @property
    def num_experts_per_tok(self) -> int:
        """Experts per token under the name the MoE helpers read (``moe_top_k``)."""
        return self.moe_top_k

    @property
    def output_router_logits(self) -> bool:
        """Always False: the published code has no router aux loss."""
        return False

    @property
    def sliding_heads(self) -> tuple[int, int]:
        """``(heads, kv heads)`` of the sliding layers: ``attention_other_setting``, else the full ones."""
        other = self.attention_other_setting or {}
        return (
            as_int(other.get("num_attention_heads", self.num_attention_heads)),
            as_int(other.get("num_attention_groups", self.num_attention_groups)),
        )

    def layer_kind(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention`` (without ``layer_types``: sliding on even layers)."""
        if self.layer_types:
            return self.layer_types[layer]
        return "sliding_attention" if layer % 2 == 0 else "full_attention"

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """``(query heads, key/value heads)`` of ``layer``."""
        if self.layer_kind(layer) == "sliding_attention":
            return self.sliding_heads
        return self.num_attention_heads, self.num_attention_groups

    def layer_theta(self, layer: int) -> float:
        """RoPE base of ``layer`` (``rope_theta``, or its entry when a list)."""
        if isinstance(self.rope_theta, list | tuple):
            return float(self.rope_theta[layer])
        return float(self.rope_theta)

    def rotary_dim(self, layer: int) -> int:
        """Rotated dims per head of ``layer``: ``int(head_dim * partial_rotary_factors[layer])``."""
        factor = 1.0 if self.partial_rotary_factors is None else float(self.partial_rotary_factors[layer])
        return int(self.head_dim * factor)

    def layer_rope_scaling(self, layer: int) -> dict[str, object] | None:
        """``rope_scaling`` when it applies to ``layer``'s type (``yarn_only_types``), else None."""
        if self.yarn_only_types is not None and self.layer_kind(layer) not in self.yarn_only_types:
            return None
        return self.rope_scaling

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the sparse layers (``moe_layers_enum``; default every layer but the first)."""
        enum = self.moe_layers_enum
        if enum is None:
            return list(range(1, self.num_hidden_layers))
        if isinstance(enum, int) and not isinstance(enum, bool):
            return [enum]  # a YAML override of one layer reads as a number
        if isinstance(enum, str):
            try:
                return [int(part) for part in enum.strip().split(",") if part.strip()]
            except ValueError:
                raise ValueError(
                    f"moe_layers_enum: must be comma-separated layer indices, got {enum!r}"
                ) from None
        if not isinstance(enum, list | tuple):
            raise ValueError(f"moe_layers_enum: must be comma-separated layer indices, got {enum!r}")
        return [int(i) for i in enum]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has the routed experts and the shared expert (else a dense MLP)."""
        return layer in self.moe_layers

    def swiglu_limit(self, layer: int, *, shared: bool) -> float | None:
        """The SwiGLU clamp of ``layer``'s routed experts (or shared expert / dense MLP), None if off."""
        limits = self.swiglu_limits_shared if shared else self.swiglu_limits
        value = None if not limits else limits[layer]
        return None if value is None or float(value) == 0.0 else float(value)

    def to_hf_dict(self) -> dict[str, object]:
        """The published ``config.json`` fields of these args."""
        return {**asdict(self), **FIXED_KEYS}

    @classmethod
    def flavors(cls) -> Mapping[str, Step3p5Args]:
        return FLAVORS

    @classmethod
    def coerce_option(cls, key: str, value: object) -> object:
        if key in FIXED_KEYS:
            if value != FIXED_KEYS[key]:
                raise ValueError(
                    f"{key}: not supported yet: {value!r} (the published Step-3.5 uses {FIXED_KEYS[key]!r})"
                )
            return value
        return super().coerce_option(key, value)

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """The ``FIXED_KEYS`` (checked by the coercion) are no fields: they are dropped here."""
        overrides = {k: v for k, v in parsed.overrides.items() if k not in FIXED_KEYS}
        return cls.apply_overrides(parsed.base, overrides)


OPTION_KEYS: frozenset[str] = Step3p5Args.option_keys()

_TINY_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]

FLAVORS: dict[str, Step3p5Args] = {
    # The published layer pattern in small: a full layer (half-rotary, theta 5e6, llama3-scaled)
    # then 3 sliding ones (more heads, window 64, theta 1e4), layer 0 dense, 8 experts top-2.
    "tiny": Step3p5Args(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_attention_groups=2,
        num_hidden_layers=4,
        head_dim=64,
        max_position_embeddings=2048,
        moe_intermediate_size=128,
        moe_num_experts=8,
        moe_top_k=2,
        moe_router_scaling_factor=3.0,
        share_expert_dim=128,
        moe_layers_enum="1,2,3",
        rope_theta=[5_000_000.0, 10_000.0, 10_000.0, 10_000.0],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 32.0,
            "original_max_position_embeddings": 1024,
        },
        yarn_only_types=["full_attention"],
        partial_rotary_factors=[0.5, 1.0, 1.0, 1.0],
        layer_types=list(_TINY_LAYERS),
        sliding_window=64,
        attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 2},
        use_head_wise_attn_gate=True,
        swiglu_limits=[0.0, 0.0, 0.0, 7.0],
        swiglu_limits_shared=[0.0, 0.0, 0.0, 16.0],
        tie_word_embeddings=False,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``Step3p5Args``.
from_options = Step3p5Args.from_options
