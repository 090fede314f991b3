"""Structural hyper-parameters of the built-in Mamba-3 family and its named flavors.

Field names and defaults follow the reference layer (``mamba_ssm.modules.mamba3.Mamba3``:
``d_state`` -> ``state_size``, ``headdim`` -> ``head_dim``, ``ngroups`` -> ``n_groups``, the
rest as they are) under the ``config.json`` spelling of flash-linear-attention's
``Mamba3Config`` (``hidden_size``, ``num_hidden_layers``, ``norm_eps``), so a folder written
here reads like one of those. This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import ClassVar, Self

from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions, require_positive

ROPE_FRACTIONS = (0.5, 1.0)


# MindSpeed-LLM's Mamba3Config (a Mamba2Config) spells the norm epsilon layer_norm_epsilon.
ALIASES = {"layer_norm_epsilon": "norm_eps"}


@dataclass(frozen=True)
class Mamba3Args(FamilyArgs):
    """Mamba-3 decoder configuration (a stack of pre-norm Mamba-3 mixer blocks, no MLP)."""

    label: ClassVar[str] = "Mamba-3"
    aliases: ClassVar[Mapping[str, str]] = ALIASES
    extra_option_keys: ClassVar[frozenset[str]] = frozenset({"num_heads"})

    vocab_size: int = 50280
    hidden_size: int = 768
    num_hidden_layers: int = 24
    state_size: int = 128
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    rope_fraction: float = 0.5
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    is_mimo: bool = False
    mimo_rank: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "state_size",
                "expand",
                "head_dim",
                "n_groups",
                "mimo_rank",
                "chunk_size",
            ),
        )
        if self.d_inner % self.head_dim:
            raise ValueError(
                f"head_dim: must divide expand * hidden_size ({self.d_inner}), got {self.head_dim}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"n_groups: must divide the number of heads (expand * hidden_size / head_dim = "
                f"{self.num_heads}), got {self.n_groups}"
            )
        if float(self.rope_fraction) not in ROPE_FRACTIONS:
            raise ValueError(f"rope_fraction: must be one of {ROPE_FRACTIONS}, got {self.rope_fraction!r}")
        if self.num_rope_angles < 1:
            raise ValueError(
                f"state_size: rope_fraction {self.rope_fraction} of {self.state_size} leaves no rotary pair; "
                "use a state_size of at least 4"
            )
        if not 0 < float(self.dt_min) <= float(self.dt_max):
            raise ValueError(f"dt_min: must be in (0, dt_max={self.dt_max}], got {self.dt_min!r}")
        if float(self.A_floor) < 0:
            raise ValueError(f"A_floor: must be >= 0, got {self.A_floor!r}")
        if float(self.norm_eps) <= 0:
            raise ValueError(f"norm_eps: must be > 0, got {self.norm_eps!r}")

    @property
    def d_inner(self) -> int:
        """Width of the mixer's value stream (``expand * hidden_size``)."""
        return self.expand * self.hidden_size

    @property
    def num_heads(self) -> int:
        """State-space heads per layer."""
        return self.d_inner // self.head_dim

    @property
    def rank(self) -> int:
        """MIMO rank (1 for the single-input single-output layer)."""
        return self.mimo_rank if self.is_mimo else 1

    @property
    def num_rope_angles(self) -> int:
        """Rotary pairs of the state: ``rope_fraction`` of ``state_size``, rounded down to pairs."""
        rotated = int(self.state_size * float(self.rope_fraction))
        return (rotated - rotated % 2) // 2

    def to_hf_dict(self) -> dict[str, object]:
        """The ``config.json`` fields (every field, plus the derived ``num_heads``)."""
        body = asdict(self)
        body["num_heads"] = self.num_heads
        return body

    @classmethod
    def flavors(cls) -> Mapping[str, Mamba3Args]:
        return FLAVORS

    @classmethod
    def prepare_options(cls, options: dict[str, object]) -> dict[str, object]:
        """``num_heads`` (written to ``config.json``) is no field: it is checked after the parse."""
        options.pop("num_heads", None)
        return options

    @classmethod
    def finish_options(cls, parsed: ParsedOptions[Self], options: Mapping[str, object]) -> Self:
        """``num_heads``, when given, must agree with the sizes it follows from."""
        args = cls.apply_overrides(parsed.base, parsed.overrides)
        heads = options.get("num_heads")
        if heads is not None and heads != args.num_heads:
            raise ValueError(
                f"num_heads: {heads!r} disagrees with expand * hidden_size / head_dim = {args.num_heads}; "
                "set head_dim instead"
            )
        return args


OPTION_KEYS: frozenset[str] = Mamba3Args.option_keys()

FLAVORS: dict[str, Mamba3Args] = {
    # The demo: 4 SISO layers of 8 heads; trains on 2 CPU cores.
    "tiny": Mamba3Args(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        state_size=32,
        head_dim=64,
        chunk_size=64,
    ),
    # For unit and distributed tests: 2 MIMO layers with the gated output norm.
    "debug": Mamba3Args(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=16,
        head_dim=16,
        is_mimo=True,
        mimo_rank=2,
        is_outproj_norm=True,
        chunk_size=8,
    ),
}


#: What ``spec.py`` calls: :meth:`FamilyArgs.from_options` of ``Mamba3Args``.
from_options = Mamba3Args.from_options


__all__ = ["ALIASES", "FLAVORS", "OPTION_KEYS", "Mamba3Args", "from_options"]
