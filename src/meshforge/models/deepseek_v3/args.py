"""Structural hyper-parameters of the built-in DeepSeek-V3 family and its named flavors.

``DeepseekV3Args`` mirrors transformers' ``DeepseekV3Config`` (5.24) field for field, same
names and defaults (except ``num_nextn_predict_layers``: 0, so a ``model:`` section that does not
ask for multi-token prediction gets none; a ``config.json`` gives its own value), so a ``config.json`` or the ``model:`` passthrough keys of a YAML map
onto it one to one (the MindFormers reference spells the experts ``n_routed_experts`` and
``num_experts_per_tok``, as transformers does). Spellings from real files accepted besides:
``num_local_experts`` (transformers' alias of ``n_routed_experts``), ``num_mtp_layers``
(its alias of ``num_nextn_predict_layers``), the older top-level ``rope_theta``, and the
derived ``head_dim`` / ``qk_head_dim`` that ``config.json`` carries (checked, not free:
transformers forces ``head_dim = qk_rope_head_dim``, the rotary width).

RoPE is ``default`` or ``yarn`` (``rope_parameters``, or the legacy ``rope_scaling`` that
``hf.py`` turns into it); ``softmax_scale`` carries YaRN's ``mscale_all_dim`` correction of the
attention scale. ``num_nextn_predict_layers`` multi-token-prediction modules are built after
the decoder (``mtp.py``; transformers builds none). This module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Self

from meshforge.models.common import arg_rules as rules
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions, as_float, positive_int, require_positive

DEFAULT_ROPE_THETA = 10_000.0


# transformers' attribute_map: config.json may carry either spelling.
ALIASES: dict[str, str] = {
    "num_local_experts": "n_routed_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
}


@dataclass(frozen=True)
class DeepseekV3Args(FamilyArgs):
    """DeepSeek-V3 decoder configuration (names and defaults of ``transformers.DeepseekV3Config``)."""

    label: ClassVar[str] = "DeepSeek-V3"
    aliases: ClassVar[Mapping[str, str]] = ALIASES

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    output_router_logits: bool = False
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = field(default=1)
    pretraining_tp: int = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, object] | None = None
    rope_theta: float | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    attention_dropout: float = 0.0
    # transformers' default is 1; here MTP blocks are built only when asked for (config.json or model:).
    num_nextn_predict_layers: int = 0
    head_dim: int | None = None
    qk_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "moe_intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "n_routed_experts",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "v_head_dim",
                "n_group",
                "topk_group",
                "num_experts_per_tok",
                "max_position_embeddings",
            ),
        )
        for name in (
            "n_shared_experts",
            "qk_nope_head_dim",
            "first_k_dense_replace",
            "num_nextn_predict_layers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        if self.q_lora_rank is not None:
            positive_int("q_lora_rank", self.q_lora_rank)
        if self.num_key_value_heads != self.num_attention_heads:
            # MLA expands keys/values to every query head through kv_b_proj; transformers then
            # repeats them num_attention_heads // num_key_value_heads more times, which only
            # works (and only means anything) when the two are equal.
            raise ValueError(
                f"num_key_value_heads: must equal num_attention_heads ({self.num_attention_heads}) for "
                f"multi-head latent attention, got {self.num_key_value_heads}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim: must be even for rotary embeddings, got {self.qk_rope_head_dim}"
            )
        if self.head_dim is not None and self.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"head_dim: DeepSeek-V3 ties it to qk_rope_head_dim ({self.qk_rope_head_dim}), "
                f"got {self.head_dim}; leave it out or set it equal"
            )
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.qk_head_dim is not None and self.qk_head_dim != qk_head_dim:
            raise ValueError(
                f"qk_head_dim: must be qk_nope_head_dim + qk_rope_head_dim ({qk_head_dim}), got {self.qk_head_dim}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group: must divide n_routed_experts ({self.n_routed_experts}), got {self.n_group}"
            )
        if self.n_routed_experts // self.n_group < 2:
            # Each group is scored by the sum of its two best experts.
            raise ValueError(
                f"n_group: each group needs at least 2 experts (n_routed_experts {self.n_routed_experts} / "
                f"n_group {self.n_group}); set n_group and topk_group to match the expert count, "
                "e.g. n_group: 1 and topk_group: 1 for no group limit"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group: must be at most n_group ({self.n_group}), got {self.topk_group}")
        selectable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > selectable:
            raise ValueError(
                f"num_experts_per_tok: must be at most topk_group * experts per group ({selectable}), "
                f"got {self.num_experts_per_tok}"
            )
        rules.check_attention_dropout(self.attention_dropout)
        if float(self.routed_scaling_factor) <= 0:
            raise ValueError(f"routed_scaling_factor: must be > 0, got {self.routed_scaling_factor!r}")
        if self.rope_parameters is not None:
            _check_rope(self.rope_parameters)

    @property
    def rope_type(self) -> str:
        """``default`` or ``yarn`` (from ``rope_parameters``; ``type`` is the legacy spelling)."""
        return _rope_type(self.rope_parameters)

    @property
    def softmax_scale(self) -> float:
        """The attention-logit scale: ``qk_head_dim ** -0.5``, times ``mscale**2`` under YaRN.

        transformers' ``yarn_apply_mscale``: with a non-zero ``mscale_all_dim`` the scale is
        multiplied by ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` (1 when factor <= 1).
        The cos/sin gain of the rotary table is a separate factor (``attention_factor``).
        """
        scale = self.attn_qk_head_dim**-0.5
        params = self.rope_parameters or {}
        all_dim = params.get("mscale_all_dim") or 0
        if self.rope_type != "default" and all_dim:
            factor = as_float(params["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * as_float(all_dim) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def attn_qk_head_dim(self) -> int:
        """Query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def theta(self) -> float:
        """The RoPE base: ``rope_parameters.rope_theta``, else ``rope_theta``, else 10000."""
        return rules.rope_base(self.rope_parameters, self.rope_theta, default=DEFAULT_ROPE_THETA)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) is sparse: from ``first_k_dense_replace`` on."""
        return layer >= self.first_k_dense_replace

    def to_hf_dict(self) -> dict[str, object]:
        """Keyword arguments for ``transformers.DeepseekV3Config`` that describe the same model."""
        out = asdict(self)
        out.pop("rope_theta")
        out.pop("qk_head_dim")
        out.pop("head_dim")
        rope = {k: v for k, v in (self.rope_parameters or {}).items() if k != "type"}
        out["rope_parameters"] = {**rope, "rope_type": self.rope_type, "rope_theta": self.theta}
        return out

    @classmethod
    def flavors(cls) -> Mapping[str, DeepseekV3Args]:
        return FLAVORS

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """``num_attention_heads`` given without ``num_key_value_heads`` sets both (MLA needs them equal)."""
        overrides = parsed.overrides
        if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
            # MLA admits one value (every query head gets its own expanded key/value), so a config
            # that sets the heads alone, as the MindFormers skeleton does, means that value.
            overrides["num_key_value_heads"] = overrides["num_attention_heads"]
        return cls.apply_overrides(parsed.base, overrides)


_YARN_KEYS = frozenset(rules.YARN_KEYS)


def _rope_type(params: dict[str, object] | None) -> str:
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def _check_rope(params: object) -> None:
    """Refuse a ``rope_parameters`` dict this family does not build, naming the key."""
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters: must be a mapping, got {params!r}")
    rope_type = _rope_type(params)
    if rope_type not in ("default", "yarn"):
        raise ValueError(
            f"rope_parameters.rope_type: not supported yet for deepseek_v3: {rope_type!r} "
            "(built: 'default', 'yarn')"
        )
    if rope_type != "yarn":
        return
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise ValueError(
            f"rope_parameters.{unknown[0]}: not a yarn key (known: {', '.join(sorted(_YARN_KEYS))})"
        )
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
        raise ValueError(f"rope_parameters.factor: rope_type yarn needs a positive number, got {factor!r}")
    original = params.get("original_max_position_embeddings")
    if original is not None and (
        isinstance(original, bool) or not isinstance(original, int) or original <= 0
    ):
        raise ValueError(
            f"rope_parameters.original_max_position_embeddings: must be a positive integer, got {original!r}"
        )
    partial = params.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor: not supported yet: {partial} (only 1.0)")


OPTION_KEYS: frozenset[str] = DeepseekV3Args.option_keys()

FLAVORS: dict[str, DeepseekV3Args] = {
    # The demo: MLA with both LoRA ranks, one dense layer then 3 sparse ones with 8 routed
    # experts in 4 groups (top-2 of the best 2 groups) plus a shared expert; trains on 2 CPU cores.
    "tiny": DeepseekV3Args(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        num_nextn_predict_layers=0,
    ),
    # For unit and distributed tests: small, one dense and one sparse layer, plain q projection.
    "debug": DeepseekV3Args(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        num_nextn_predict_layers=0,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``DeepseekV3Args``.
from_options = DeepseekV3Args.from_options
