"""Structural hyper-parameters of the built-in Llama family (Llama 3 / 3.1 / 3.2) and its flavors.

``LlamaArgs`` mirrors transformers' ``LlamaConfig`` (5.24) field for field, with the
same names and defaults, so a ``config.json`` or the ``model:`` passthrough keys of a
YAML map onto it one to one. RoPE is described as transformers 5.24 does it, in
``rope_parameters`` (``rope_type`` ``default`` or ``llama3`` with ``factor``,
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
the spellings that published Llama 3.1 ``config.json`` files still carry, a
top-level ``rope_theta`` and a ``rope_scaling`` dict, are accepted and folded in.
This module does not import torch, so the config system can check option keys
without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Self

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions, as_float, as_int, number, require_positive

DEFAULT_ROPE_THETA = 10_000.0
# The RoPE types the model can build (``meshforge.models.common.rope.ROPE_TYPES``,
# repeated here because that module imports torch).
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaArgs(FamilyArgs):
    """Llama decoder configuration (names and defaults of ``transformers.LlamaConfig``).

    ``head_dim`` and ``num_key_value_heads`` default (None) to ``hidden_size //
    num_attention_heads`` and ``num_attention_heads``, as in transformers. ``rope_theta``
    and ``rope_scaling`` are the legacy spellings of ``rope_parameters`` entries; use
    :attr:`rope` for the resolved dict.
    """

    label: ClassVar[str] = "Llama"
    label_unknown: ClassVar[bool] = True

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = field(default=2)
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, object] | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, object] | None = None

    def __post_init__(self) -> None:
        require_positive(self, ("hidden_size", "num_attention_heads"))
        head_dim = self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim
        object.__setattr__(self, "head_dim", head_dim)
        kv_heads = self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads
        object.__setattr__(self, "num_key_value_heads", kv_heads)
        require_positive(
            self,
            (
                "vocab_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            ),
        )
        if self.hidden_size % self.num_attention_heads:
            # transformers' LlamaConfig refuses this even when head_dim is given, so such
            # a model could not be exported; say so here rather than at export time.
            raise ValueError(
                f"hidden_size: must be a multiple of num_attention_heads ({self.num_attention_heads}), "
                f"got {self.hidden_size} (transformers' LlamaConfig requires it)"
            )
        rules.check_kv_heads(self.num_attention_heads, kv_heads)
        if head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {head_dim}")
        rules.check_attention_dropout(self.attention_dropout)
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id: must be in [0, vocab_size={self.vocab_size}) or null, got {self.pad_token_id}"
            )
        for name in ("rope_parameters", "rope_scaling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name}: must be a mapping, got {value!r}")
        for name in ("rope_scaling", "rope_parameters"):
            inner = (getattr(self, name) or {}).get("rope_theta")
            if self.rope_theta is not None and inner is not None and float(inner) != float(self.rope_theta):
                # transformers would silently keep the dict's value; two bases is a mistake.
                raise ValueError(
                    f"rope_theta: {self.rope_theta} conflicts with {name}.rope_theta {inner}; give one "
                    f"(to change the base of a loaded config, override {name} as a whole)"
                )
        self._check_rope(self.rope)

    @staticmethod
    def _check_rope(rope: dict[str, object]) -> None:
        rope_type = rope["rope_type"]
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters.rope_type: not supported yet: rope_type {rope_type} "
                f"(built: {', '.join(ROPE_TYPES)})"
            )
        partial = rope.get("partial_rotary_factor")
        if partial is not None and partial != 1.0:
            raise ValueError(
                f"rope_parameters.partial_rotary_factor: not supported yet: {partial} (only 1.0)"
            )
        _positive_number("rope_parameters.rope_theta", rope["rope_theta"])
        if rope_type != "llama3":
            return
        for key in LLAMA3_KEYS:
            if rope.get(key) is None:
                raise ValueError(
                    f"rope_parameters.{key}: required for rope_type llama3 (needs {', '.join(LLAMA3_KEYS)})"
                )
            _positive_number(f"rope_parameters.{key}", rope[key])
        original = rope["original_max_position_embeddings"]
        if as_float(original) != as_int(original):
            raise ValueError(
                f"rope_parameters.original_max_position_embeddings: must be an integer, got {original!r}"
            )
        if rope["high_freq_factor"] == rope["low_freq_factor"]:
            raise ValueError(
                "rope_parameters.high_freq_factor: must differ from low_freq_factor "
                f"({rope['low_freq_factor']}), got {rope['high_freq_factor']}"
            )

    @property
    def rope(self) -> dict[str, object]:
        """The resolved transformers ``rope_parameters`` dict.

        ``rope_scaling`` entries are the base, ``rope_parameters`` entries win over
        them; ``rope_type`` defaults to ``default`` (legacy ``type`` accepted),
        ``rope_theta`` to the top-level ``rope_theta`` or 10000, and a llama3
        ``original_max_position_embeddings`` to ``max_position_embeddings`` (as
        transformers' ``standardize_rope_params`` does).
        """
        rope = {**(self.rope_scaling or {}), **(self.rope_parameters or {})}
        rope_type = rope.pop("type", None)
        rope.setdefault("rope_type", rope_type or "default")
        if rope.get("rope_theta") is None:
            rope["rope_theta"] = self.rope_theta if self.rope_theta is not None else DEFAULT_ROPE_THETA
        if rope["rope_type"] == "llama3":
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return rope

    @property
    def theta(self) -> float:
        """The RoPE base wavelength."""
        return as_float(self.rope["rope_theta"])

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.LlamaConfig`` that describe the same model."""
        out = asdict(self)
        out.pop("rope_theta")
        out.pop("rope_scaling")
        out["rope_parameters"] = self.rope
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, LlamaArgs]:
        return FLAVORS

    @classmethod
    def coerce_option(cls, key: str, value: object) -> object:
        """Normalise one option value: numbers from strings, bools strict, RoPE dict entries too."""
        if key in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
            out = dict(value)
            for sub, raw in value.items():
                if raw is None:
                    continue
                if sub in _ROPE_FLOAT_KEYS or sub == "partial_rotary_factor":
                    out[sub] = number(f"{key}.{sub}", raw, integer=False)
                elif sub == "original_max_position_embeddings":
                    out[sub] = number(f"{key}.{sub}", raw, integer=True)
            return out
        return super().coerce_option(key, value)

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """A flavor's ``rope_parameters`` is replaced as a whole when the options give one."""
        base, overrides, flavor = parsed
        if flavor is not None:
            if "hidden_size" in overrides or "num_attention_heads" in overrides:
                # A flavor's derived head_dim follows a changed width unless given explicitly.
                overrides.setdefault("head_dim", None)
            if "rope_parameters" not in overrides and {"rope_theta", "rope_scaling"} & overrides.keys():
                # The legacy spellings replace the flavor's RoPE instead of being shadowed by it.
                overrides["rope_parameters"] = None
                scaling = overrides.get("rope_scaling")
                if overrides.get("rope_theta") is None and not (
                    isinstance(scaling, dict) and "rope_theta" in scaling
                ):
                    overrides["rope_theta"] = base.theta
        return cls.apply_overrides(base, overrides)


def _positive_number(key: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{key}: must be a positive number, got {value!r}")


OPTION_KEYS: frozenset[str] = LlamaArgs.option_keys()

FLAVORS: dict[str, LlamaArgs] = {
    # A tiny Llama 3.2-style model (tied embeddings, llama3 RoPE scaling from a 512-token
    # pre-training context) for the example config: a few million parameters, minutes on 2 cores.
    "tiny": LlamaArgs(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ),
    # For unit and distributed tests: as small as still exercises GQA and an untied head.
    "debug": LlamaArgs(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
    ),
}


_ROPE_FLOAT_KEYS = frozenset({"rope_theta", "factor", "low_freq_factor", "high_freq_factor"})


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``LlamaArgs``.
from_options = LlamaArgs.from_options
