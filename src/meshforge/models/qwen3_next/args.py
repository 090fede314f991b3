"""Structural hyper-parameters of the built-in Qwen3-Next family and its named flavors.

``Qwen3NextArgs`` mirrors transformers' ``Qwen3NextConfig`` (5.24) field for field,
same names and defaults, so a ``config.json`` or the ``model:`` passthrough keys of a
YAML map onto it one to one. Spellings of published and older files are accepted
besides: ``full_attention_interval`` (every n-th layer is full attention; it fills
``layer_types`` when that is not given, 4 by default as in transformers), top-level
``rope_theta`` and ``partial_rotary_factor`` (folded into ``rope_parameters``),
``rope_scaling: null`` and ``use_sliding_window: false`` (Qwen3-Next has neither).
This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Self

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions, positive_int, require_positive

DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LAYER_TYPES: tuple[str, ...] = ("linear_attention", "full_attention")


# Keys of published config.json files that carry no information for this model when they hold
# the value given here (anything else is refused by name in `from_options`).
_NEUTRAL_KEYS: dict[str, object] = {"rope_scaling": None, "use_sliding_window": False}


@dataclass(frozen=True)
class Qwen3NextArgs(FamilyArgs):
    """Qwen3-Next decoder configuration (names and defaults of ``transformers.Qwen3NextConfig``)."""

    label: ClassVar[str] = "Qwen3-Next"
    extra_option_keys: ClassVar[frozenset[str]] = frozenset({"sliding_window", *_NEUTRAL_KEYS})

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, object] | None = None
    rope_theta: float | None = None
    partial_rotary_factor: float | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None
    layer_types: list[str] | None = None
    full_attention_interval: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.mlp_only_layers is None:
            object.__setattr__(self, "mlp_only_layers", [])
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "head_dim",
                "linear_conv_kernel_dim",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_num_key_heads",
                "linear_num_value_heads",
                "decoder_sparse_step",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "num_experts_per_tok",
                "num_experts",
            ),
        )
        rules.check_kv_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_key_heads: must divide linear_num_value_heads ({self.linear_num_value_heads}), "
                f"got {self.linear_num_key_heads}"
            )
        rules.check_routing(
            self.num_experts_per_tok,
            self.num_experts,
            experts_key="num_experts",
            aux_loss_coef=self.router_aux_loss_coef,
        )
        if self.full_attention_interval is not None:
            positive_int("full_attention_interval", self.full_attention_interval)
        self._check_layer_lists()
        rules.check_attention_dropout(self.attention_dropout)
        self._check_rope()

    def _check_layer_lists(self) -> None:
        rules.check_layer_indices("mlp_only_layers", self.mlp_only_layers, self.num_hidden_layers)
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, list | tuple) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: needs one entry per layer ({self.num_hidden_layers}), got {self.layer_types!r}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]: must be one of {list(LAYER_TYPES)}, got {kind!r}")

    def _check_rope(self) -> None:
        rules.check_default_rope(self.rope_parameters)
        factor = self.rotary_factor
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {factor!r}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor: head_dim ({self.head_dim}) x {factor} = {self.rotary_dim} rotated "
                "dimensions; must be a positive even number"
            )

    @property
    def theta(self) -> float:
        """The RoPE base: ``rope_parameters.rope_theta``, else ``rope_theta``, else 10000."""
        return rules.rope_base(self.rope_parameters, self.rope_theta, default=DEFAULT_ROPE_THETA)

    @property
    def rotary_factor(self) -> float:
        """Share of ``head_dim`` that is rotated (transformers' ``partial_rotary_factor``, 0.25 by default)."""
        legacy = (
            DEFAULT_PARTIAL_ROTARY_FACTOR
            if self.partial_rotary_factor is None
            else self.partial_rotary_factor
        )
        return rules.rotary_share(self.rope_parameters, fallback=float(legacy))

    @property
    def rotary_dim(self) -> int:
        """Rotated dimensions per attention head: ``int(head_dim * rotary_factor)``, as transformers."""
        return int(self.head_dim * self.rotary_factor)

    @property
    def resolved_layer_types(self) -> list[str]:
        """``layer_types``, or transformers' rule: full attention on every ``full_attention_interval``-th layer."""
        if self.layer_types is not None:
            return list(self.layer_types)
        interval = self.full_attention_interval or DEFAULT_FULL_ATTENTION_INTERVAL
        return [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has the sparse MoE block, by transformers' rule."""
        assert self.mlp_only_layers is not None  # __post_init__ replaces None by []
        return rules.is_sparse_layer(
            layer,
            mlp_only_layers=self.mlp_only_layers,
            num_experts=self.num_experts,
            decoder_sparse_step=self.decoder_sparse_step,
        )

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.Qwen3NextConfig`` that describe the same model."""
        out = asdict(self)
        for key in ("rope_theta", "partial_rotary_factor", "full_attention_interval"):
            out.pop(key)
        assert self.mlp_only_layers is not None  # __post_init__ replaces None by []
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        out["layer_types"] = self.resolved_layer_types
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.theta,
            "partial_rotary_factor": self.rotary_factor,
        }
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, Qwen3NextArgs]:
        return FLAVORS

    @classmethod
    def prepare_options(cls, options: dict[str, object]) -> dict[str, object]:
        """``rope_scaling`` must be null and ``use_sliding_window`` false (Qwen3-Next has neither).

        ``sliding_window`` is then ignored, as transformers ignores it.
        """
        for key, neutral in _NEUTRAL_KEYS.items():
            if key in options and options.pop(key) != neutral:
                raise ValueError(f"{key}: not supported yet for qwen3_next (only {neutral!r})")
        options.pop("sliding_window", None)
        return options

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """A new layer count or interval re-derives the layer kinds unless they are given too."""
        overrides = dict(parsed.overrides)
        if "layer_types" not in overrides and {"num_hidden_layers", "full_attention_interval"} & set(
            overrides
        ):
            overrides["layer_types"] = None
        return cls.apply_overrides(parsed.base, overrides)


OPTION_KEYS: frozenset[str] = Qwen3NextArgs.option_keys()

FLAVORS: dict[str, Qwen3NextArgs] = {
    # The demo: 4 layers (3 Gated DeltaNet + 1 gated attention), 8 experts top-2 with a shared
    # expert; trains on 2 CPU cores.
    "tiny": Qwen3NextArgs(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        full_attention_interval=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    # For unit and distributed tests: one layer of each kind, the first one dense.
    "debug": Qwen3NextArgs(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        output_router_logits=True,
        full_attention_interval=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``Qwen3NextArgs``.
from_options = Qwen3NextArgs.from_options
