"""Structural hyper-parameters of the built-in Qwen3-MoE family and its named flavors.

``Qwen3MoeArgs`` mirrors transformers' ``Qwen3MoeConfig`` (5.24) field for field,
same names and defaults, so a ``config.json`` or the ``model:`` passthrough keys of
a YAML map onto it one to one. Two spellings from real files are accepted besides:
``num_local_experts`` (what ``config.json`` carries, because transformers maps
``num_experts`` to it) and the older top-level ``rope_theta``. ``head_dim`` is not a
``Qwen3MoeConfig`` field but transformers reads it when present (published Qwen3-MoE
checkpoints set it to 128 with hidden/heads = 64); None means hidden / heads.
This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import positive_int, require_positive

DEFAULT_ROPE_THETA = 10_000.0


# ``num_local_experts`` is how config.json spells ``num_experts`` (transformers' attribute_map).
ALIASES: dict[str, str] = {"num_local_experts": "num_experts"}


@dataclass(frozen=True)
class Qwen3MoeArgs(FamilyArgs):
    """Qwen3-MoE decoder configuration (names and defaults of ``transformers.Qwen3MoeConfig``)."""

    label: ClassVar[str] = "Qwen3-MoE"
    aliases: ClassVar[Mapping[str, str]] = ALIASES

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
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
    attention_dropout: float = 0.0
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        kv_heads = self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads
        object.__setattr__(self, "num_key_value_heads", kv_heads)
        if self.mlp_only_layers is None:
            object.__setattr__(self, "mlp_only_layers", [])
        if not self.use_sliding_window:
            # As Qwen3MoeConfig does: the window only exists when sliding attention is on.
            object.__setattr__(self, "sliding_window", None)
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
                "decoder_sparse_step",
                "moe_intermediate_size",
                "num_experts_per_tok",
                "num_experts",
            ),
        )
        rules.check_kv_heads(self.num_attention_heads, kv_heads)
        if self.head_dim is not None:
            positive_int("head_dim", self.head_dim)
        if self.attn_head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.attn_head_dim}")
        rules.check_routing(
            self.num_experts_per_tok,
            self.num_experts,
            experts_key="num_experts",
            aux_loss_coef=self.router_aux_loss_coef,
        )
        rules.check_layer_indices("mlp_only_layers", self.mlp_only_layers, self.num_hidden_layers)
        rules.check_attention_dropout(self.attention_dropout)
        rules.check_default_rope(self.rope_parameters)

    @property
    def attn_head_dim(self) -> int:
        """Per-head size: ``head_dim`` if set, else ``hidden_size // num_attention_heads`` (as transformers)."""
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def theta(self) -> float:
        """The RoPE base: ``rope_parameters.rope_theta``, else ``rope_theta``, else 10000."""
        return rules.rope_base(self.rope_parameters, self.rope_theta, default=DEFAULT_ROPE_THETA)

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
        """Keyword arguments for ``transformers.Qwen3MoeConfig`` that describe the same model."""
        out = asdict(self)
        out.pop("rope_theta")
        out["head_dim"] = self.attn_head_dim
        assert self.mlp_only_layers is not None  # __post_init__ replaces None by []
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.theta}
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, Qwen3MoeArgs]:
        return FLAVORS


OPTION_KEYS: frozenset[str] = Qwen3MoeArgs.option_keys()

FLAVORS: dict[str, Qwen3MoeArgs] = {
    # The demo MoE: 8 experts, top-2, every layer sparse; trains on 2 CPU cores.
    "tiny": Qwen3MoeArgs(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    # For unit and distributed tests: small, but with a dense layer (mlp_only_layers).
    "debug": Qwen3MoeArgs(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        num_hidden_layers=2,
        mlp_only_layers=[0],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``Qwen3MoeArgs``.
from_options = Qwen3MoeArgs.from_options
