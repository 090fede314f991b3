"""The shared attention core ``attend`` and the shared option parsing of ``FamilyArgs``.

The families' own tests check each attention module against transformers; these cases pin
what ``attend`` itself decides (which path runs, what it hands the CP plan, which errors it
raises) and what ``FamilyArgs.from_options`` does with a family's class attributes and hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.common.attention import attend, segment_causal_mask
from meshforge.models.common.family_args import FamilyArgs
from meshforge.models.common.options import ParsedOptions
from meshforge.models.common.sink_attention import causal_mask

B, H, KV, S, D = 2, 4, 2, 6, 8


def _qkv(dv: int = D) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, S, D, generator=g),
        torch.randn(B, KV, S, D, generator=g),
        torch.randn(B, KV, S, dv, generator=g),
    )


def test_no_mask_is_causal_sdpa_with_shared_kv_heads():
    q, k, v = _qkv()
    out = attend(q, k, v, None, scale=0.3)
    repeated = [t.repeat_interleave(H // KV, dim=1) for t in (k, v)]
    expected = F.scaled_dot_product_attention(q, *repeated, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected)


def test_values_of_their_own_head_size():
    q, k, v = _qkv(dv=5)
    segments = torch.tensor([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]])
    out = attend(q, k, v, segment_causal_mask(segments), scale=0.3)
    assert out.shape == (B, H, S, 5)


def test_sinks_that_never_win_give_plain_attention():
    # A sink logit far below every score takes no probability: the grouping of query heads by
    # their key/value head must then match SDPA's GQA exactly.
    q, k, v = _qkv()
    sinks = torch.full((H,), -1e4)
    mask = causal_mask(S, "cpu")
    out = attend(q, k, v, mask, scale=0.3, sinks=sinks)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected)


def test_a_large_sink_takes_the_probability_of_its_head_only():
    q, k, v = _qkv()
    sinks = torch.zeros(H)
    sinks[1] = 1e4
    out = attend(q, k, v, causal_mask(S, "cpu"), scale=0.3, sinks=sinks)
    assert out[:, 1].abs().max() < 1e-6
    assert out[:, 0].abs().max() > 1e-2 and out[:, 2].abs().max() > 1e-2


def test_sinks_need_a_mask():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sink attention needs the boolean mask"):
        attend(q, k, v, None, scale=0.3, sinks=torch.zeros(H))


class _Plan:
    """A CP plan stand-in that records how it was called."""

    def __init__(self, accepts_sinks: bool) -> None:
        self.calls: list[dict[str, Any]] = []
        self.accepts_sinks = accepts_sinks

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any
    ) -> torch.Tensor:
        if not self.accepts_sinks:
            assert set(kw) == {"scale"}
        self.calls.append({"mask": mask, **kw})
        return torch.zeros_like(q)


def test_the_cp_plan_replaces_the_local_attention():
    q, k, v = _qkv()
    plan = _Plan(accepts_sinks=False)
    marker = object()
    out = attend(q, k, v, marker, scale=0.3, cp=plan, flash=True, flash_strict=True)
    assert torch.equal(out, torch.zeros_like(q))
    assert plan.calls == [{"mask": marker, "scale": 0.3}]
    sinks = torch.zeros(H)
    plan = _Plan(accepts_sinks=True)
    attend(q, k, v, marker, scale=0.3, cp=plan, sinks=sinks, window=4)
    assert plan.calls[0]["sinks"] is sinks and plan.calls[0]["window"] == 4


def test_dropout_is_refused_under_cp():
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match="attention_dropout: not supported yet with parallelism.context_parallel"
    ):
        attend(q, k, v, None, scale=0.3, dropout=0.1, cp=_Plan(accepts_sinks=False))


def test_strict_flash_refuses_a_packed_batch_and_auto_runs_plain_sdpa():
    q, k, v = _qkv()
    mask = segment_causal_mask(torch.tensor([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="kernels.use_flash_attn: flash attention takes no mask"):
        attend(q, k, v, mask, scale=0.3, flash=True, flash_strict=True)
    # auto: the masked forward leaves the flash backend aside (which this CPU would not have).
    out = attend(q, k, v, mask, scale=0.3, flash=True)
    torch.testing.assert_close(out, attend(q, k, v, mask, scale=0.3))


@dataclass(frozen=True)
class _ToyArgs(FamilyArgs):
    label: ClassVar[str] = "Toy"
    aliases: ClassVar[Mapping[str, str]] = {"width": "hidden_size"}
    extra_option_keys: ClassVar[frozenset[str]] = frozenset({"heads_hint"})

    hidden_size: int = 8
    eps: float = 1e-6
    tied: bool = False

    @classmethod
    def flavors(cls) -> Mapping[str, FamilyArgs]:
        return {"small": _ToyArgs(hidden_size=4)}

    @classmethod
    def prepare_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        options.pop("heads_hint", None)
        return options

    @classmethod
    def finish_options(cls, parsed: ParsedOptions, options: Mapping[str, Any]) -> Self:
        args = replace(parsed.base, **parsed.overrides)
        if options.get("heads_hint") not in (None, args.hidden_size // 2):
            raise ValueError("heads_hint: disagrees with hidden_size")
        return args


def test_family_args_from_options():
    assert _ToyArgs.option_keys() == {"hidden_size", "eps", "tied", "flavor", "width", "heads_hint"}
    assert _ToyArgs.from_options({}) == _ToyArgs()
    assert _ToyArgs.from_options({"flavor": "small", "eps": "1e-5"}) == _ToyArgs(hidden_size=4, eps=1e-5)
    assert _ToyArgs.from_options({"width": "16", "heads_hint": 8}).hidden_size == 16
    with pytest.raises(ValueError, match="heads_hint: disagrees"):
        _ToyArgs.from_options({"width": 16, "heads_hint": 3})
    with pytest.raises(
        ValueError, match=r"unknown Toy model option\(s\): 'hiden_size' \(did you mean 'hidden_size'\?\)"
    ):
        _ToyArgs.from_options({"hiden_size": 3})
    with pytest.raises(ValueError, match="flavor: unknown Toy flavor 'big'"):
        _ToyArgs.from_options({"flavor": "big"})
    with pytest.raises(ValueError, match="tied: must be true or false"):
        _ToyArgs.from_options({"tied": 1})
    with pytest.raises(ValueError, match="width: is another name for hidden_size"):
        _ToyArgs.from_options({"width": 2, "hidden_size": 4})
