"""Structural hyper-parameters of the built-in Qwen3 family and its named flavors.

``Qwen3Args`` mirrors transformers' ``Qwen3Config`` (5.24) field for field, with the
same names and defaults, so a ``config.json`` or the ``model:`` passthrough keys of a
YAML map onto it one to one. Besides ``rope_parameters`` (how transformers 5.24
spells RoPE) it accepts the older top-level ``rope_theta`` that most published
``config.json`` files still carry. This module does not import torch, so the config
system can check option keys without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import require_positive

DEFAULT_ROPE_THETA = 10_000.0
# Sizes that must be positive integers.
POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class Qwen3Args(FamilyArgs):
    """Qwen3 decoder configuration (names and defaults of ``transformers.Qwen3Config``)."""

    label: ClassVar[str] = "Qwen3"
    label_unknown: ClassVar[bool] = True

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, object] | None = None
    rope_theta: float | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        kv_heads = self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads
        object.__setattr__(self, "num_key_value_heads", kv_heads)
        require_positive(self, POSITIVE_FIELDS)
        rules.check_kv_heads(self.num_attention_heads, kv_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        rules.check_attention_dropout(self.attention_dropout)
        rules.check_default_rope(self.rope_parameters)
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: needs one entry per layer ({self.num_hidden_layers}), got {len(self.layer_types)}"
            )

    @property
    def theta(self) -> float:
        """The RoPE base: ``rope_parameters.rope_theta``, else ``rope_theta``, else 10000."""
        return rules.rope_base(self.rope_parameters, self.rope_theta, default=DEFAULT_ROPE_THETA)

    @property
    def uses_sliding_window(self) -> bool:
        """Whether any layer would use sliding-window attention (as transformers derives it)."""
        if self.layer_types is not None:
            return "sliding_attention" in self.layer_types
        return bool(
            self.use_sliding_window
            and self.sliding_window is not None
            and self.max_window_layers < self.num_hidden_layers
        )

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.Qwen3Config`` that describe the same model."""
        out = asdict(self)
        out.pop("rope_theta")
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.theta}
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, Qwen3Args]:
        return FLAVORS


OPTION_KEYS: frozenset[str] = Qwen3Args.option_keys()

FLAVORS: dict[str, Qwen3Args] = {
    # The demo model: a few million parameters, trains on 2 CPU cores in minutes.
    "tiny": Qwen3Args(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    # For unit and distributed tests: as small as still exercises GQA and q/k norms.
    "debug": Qwen3Args(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``Qwen3Args``.
from_options = Qwen3Args.from_options
