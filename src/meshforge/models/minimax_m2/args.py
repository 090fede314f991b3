"""Structural hyper-parameters of the built-in MiniMax-M2 family and its named flavors.

``MiniMaxM2Args`` mirrors transformers' ``MiniMaxM2Config`` (5.24) field for field, same names
and defaults, so a ``config.json`` or the ``model:`` passthrough keys of a YAML map onto it one to
one. Published MiniMax-M2 files spell two things the older way, and both are read: the top-level
``rope_theta`` and ``rotary_dim`` (the rotated dims per head; transformers turns it into
``partial_rotary_factor = rotary_dim / head_dim``). ``num_experts`` is read as
``num_local_experts`` (transformers' ``attribute_map``). This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import positive_int, require_positive

DEFAULT_ROPE_THETA = 5_000_000.0


# transformers' attribute_map: `num_experts` is another name of `num_local_experts`.
ALIASES: dict[str, str] = {"num_experts": "num_local_experts"}


@dataclass(frozen=True)
class MiniMaxM2Args(FamilyArgs):
    """MiniMax-M2 decoder configuration (names and defaults of ``transformers.MiniMaxM2Config``)."""

    label: ClassVar[str] = "MiniMax-M2"
    aliases: ClassVar[Mapping[str, str]] = ALIASES

    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 196608
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 200034
    eos_token_id: int | list[int] | None = field(default=200020)
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    num_experts_per_tok: int = 8
    num_local_experts: int = 256
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    rope_parameters: dict[str, object] | None = None
    rope_theta: float | None = None
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
                "num_experts_per_tok",
                "num_local_experts",
            ),
        )
        rules.check_kv_heads(self.num_attention_heads, self.num_key_value_heads)
        rules.check_routing(
            self.num_experts_per_tok,
            self.num_local_experts,
            experts_key="num_local_experts",
            aux_loss_coef=self.router_aux_loss_coef,
        )
        rules.check_attention_dropout(self.attention_dropout)
        if float(self.router_jitter_noise) != 0.0:
            raise ValueError(
                f"router_jitter_noise: not supported yet: {self.router_jitter_noise!r} (only 0.0, "
                "what published MiniMax-M2 checkpoints use)"
            )
        self._check_rope()

    def _check_rope(self) -> None:
        rules.check_default_rope(self.rope_parameters)
        if self.rotary_dim is not None:
            positive_int("rotary_dim", self.rotary_dim)
        factor = self.rotary_factor
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"rope_parameters.partial_rotary_factor: must be in (0, 1], got {factor!r}")
        dim = self.attn_rotary_dim
        if dim <= 0 or dim % 2:
            raise ValueError(
                f"rotary_dim: head_dim ({self.head_dim}) x partial_rotary_factor {factor} = {dim} rotated "
                "dimensions; must be a positive even number"
            )

    @property
    def theta(self) -> float:
        """The RoPE base: ``rope_parameters.rope_theta``, else ``rope_theta``, else 5e6 (transformers' default)."""
        return rules.rope_base(self.rope_parameters, self.rope_theta, default=DEFAULT_ROPE_THETA)

    @property
    def rotary_factor(self) -> float:
        """Share of ``head_dim`` that is rotated: ``partial_rotary_factor``, else ``rotary_dim / head_dim``, else 1."""
        legacy = 1.0 if self.rotary_dim is None else self.rotary_dim / self.head_dim
        return rules.rotary_share(self.rope_parameters, fallback=legacy)

    @property
    def attn_rotary_dim(self) -> int:
        """Rotated dimensions per head: ``int(head_dim * rotary_factor)``, as transformers computes it."""
        return int(self.head_dim * self.rotary_factor)

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.MiniMaxM2Config`` that describe the same model."""
        out = asdict(self)
        out.pop("rope_theta")
        out.pop("rotary_dim")
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.theta,
            "partial_rotary_factor": self.rotary_factor,
        }
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, MiniMaxM2Args]:
        return FLAVORS


OPTION_KEYS: frozenset[str] = MiniMaxM2Args.option_keys()

FLAVORS: dict[str, MiniMaxM2Args] = {
    # The demo MoE: 8 experts, top-2, half-rotary heads as published; trains on 2 CPU cores.
    "tiny": MiniMaxM2Args(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rotary_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    ),
    # For unit and distributed tests.
    "debug": MiniMaxM2Args(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``MiniMaxM2Args``.
from_options = MiniMaxM2Args.from_options
