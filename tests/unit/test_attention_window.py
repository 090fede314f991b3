"""``kernels.pre_tokens``: a banded causal window on every attention kind, packed rows included.

Each attention kind of the built-in families (the common attention, MLA, gpt-oss' sink
attention on its full and sliding layers, qwen3_next's gated attention, minimax_m2's) runs
with ``pre_tokens`` set and is compared with a float64 copy of itself that gets no window
setting but an explicit band mask written out position by position: query i sees key j when
``0 <= i - j <= pre_tokens``. Every case also checks that the window changed the output, so a
band that cut nothing would fail. The switch reaches the modules through ``configure_kernels``
as a run sets it; ``next_tokens`` other than 0 and the combinations that cannot run are refused
by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from meshforge.config import ConfigError, config_from_dict
from meshforge.models.common.attention import AttentionBase, attend, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, resolve_kernel_options
from meshforge.models.common.sink_attention import causal_mask
from meshforge.models.registry import SPECS
from tests._compare import rel_error

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}
SEQ = 12
PRE = 3
TOL = 1e-5


def band(q_len: int, k_len: int, pre_tokens: int) -> torch.Tensor:
    """The explicit band ``[1, 1, S_q, S_k]``: the queries are the last ``S_q`` key positions."""
    offset = k_len - q_len
    rows = [[0 <= (i + offset) - j <= pre_tokens for j in range(k_len)] for i in range(q_len)]
    return torch.tensor(rows)[None, None]


def _build(family: str, **options: object) -> nn.Module:
    torch.manual_seed(0)
    return SPEC_BY_NAME[family].build({"flavor": "tiny", **options}, device="cpu")


def _attention_calls(model: nn.Module, input_ids: torch.Tensor) -> list[tuple[AttentionBase, tuple]]:
    """``(attention module, its forward args)`` of every attention call of one forward."""
    calls: list[tuple[AttentionBase, tuple]] = []

    def record(module: nn.Module, args: tuple) -> None:
        assert isinstance(module, AttentionBase)
        calls.append((module, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, AttentionBase)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls, "no attention layer ran"
    return calls


def _as64(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float64)
    if isinstance(value, tuple):
        return tuple(_as64(v) for v in value)
    return value


def _check_module(module: AttentionBase, args: tuple, pre_tokens: int) -> None:
    """The windowed module (float32) against its float64 copy given the explicit band mask."""
    x, rope, mask = args
    own = mask if isinstance(mask, torch.Tensor) else causal_mask(x.shape[1], "cpu")
    reference = copy.deepcopy(module).to(torch.float64)
    reference.pre_tokens = None
    with torch.no_grad():
        module.pre_tokens = pre_tokens
        got = module(x, rope, mask)
        module.pre_tokens = None
        full = module(x, rope, mask)
        want = reference(_as64(x), _as64(rope), own & band(x.shape[1], x.shape[1], pre_tokens))
    name = type(module).__name__
    assert rel_error(got, want) <= TOL, (name, rel_error(got, want))
    assert rel_error(full, want) > 1e-3, f"{name}: the window cut nothing"


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("qwen3", "Attention"),
        ("deepseek_v3", "MultiHeadLatentAttention"),
        ("gpt_oss", "SinkAttention"),
        ("qwen3_next", "GatedAttention"),
        ("minimax_m2", "MiniMaxM2Attention"),
    ],
)
def test_each_attention_kind_equals_the_explicit_band(family: str, kind: str) -> None:
    model = _build(family)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    calls = _attention_calls(model, ids)
    assert {type(m).__name__ for m, _ in calls} == {kind}
    for module, args in calls:
        _check_module(module, args, PRE)


def test_sink_layers_take_the_narrower_of_their_window_and_pre_tokens() -> None:
    # Sliding layers of window 5 (the query and 4 earlier keys) against pre_tokens 2 and 6.
    model = _build("gpt_oss", sliding_window=5)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(2))
    sliding = [(m, a) for m, a in _attention_calls(model, ids) if m.sliding_window is not None]
    assert sliding
    for module, (x, rope, mask) in sliding:
        with torch.no_grad():
            plain = module(x, rope, mask)
            module.pre_tokens = 6  # wider than the layer's own window: nothing changes
            wide = module(x, rope, mask)
            module.pre_tokens = 2
            narrow = module(x, rope, mask)
            module.pre_tokens = None
            explicit = module(x, rope, causal_mask(SEQ, "cpu") & band(SEQ, SEQ, 2))
        assert torch.equal(wide, plain)
        assert rel_error(narrow, explicit) <= TOL
        assert rel_error(narrow, plain) > 1e-3


def _reference(q, k, v, allowed, scale):
    """Softmax attention written out in float64, key/value heads repeated for their groups."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


def test_attend_bands_masks_and_cached_queries() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, SEQ, 8, generator=g),
        torch.randn(2, 2, SEQ, 8, generator=g),
        torch.randn(2, 2, SEQ, 8, generator=g),
    )
    segments = torch.tensor([[1] * 5 + [2] * 7, [1] * 8 + [2] * 2 + [0] * 2])
    for mask in (None, segment_causal_mask(segments)):
        allowed = band(SEQ, SEQ, PRE) if mask is None else mask & band(SEQ, SEQ, PRE)
        got = attend(q, k, v, mask, scale=0.3, pre_tokens=PRE)
        assert rel_error(got, _reference(q, k, v, allowed, 0.3)) <= TOL
    # Three queries at the end of twelve cached keys (no mask: every earlier key).
    got = attend(q[:, :, -3:], k, v, None, scale=0.3, pre_tokens=PRE)
    assert rel_error(got, _reference(q[:, :, -3:], k, v, band(3, SEQ, PRE), 0.3)) <= TOL
    # A band as wide as the row cuts nothing: the mask-free causal path, bit for bit.
    assert torch.equal(attend(q, k, v, None, scale=0.3, pre_tokens=SEQ - 1), attend(q, k, v, None, scale=0.3))


def test_packed_rows_equal_each_document_alone() -> None:
    # Window and documents together: every document of a packed row gives the logits it gives
    # alone in its own row (positions restart per document), window applied in both.
    model = _build("qwen3").to(torch.float64)
    model.configure_kernels(KernelOptions(pre_tokens=PRE))
    lengths = [5, 7]
    ids = torch.randint(
        0, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)
    )
    segments = torch.tensor([[1] * lengths[0] + [2] * lengths[1]])
    with torch.no_grad():
        packed = model(ids, None, segments)
        start = 0
        for n in lengths:
            alone = model(ids[:, start : start + n])
            assert rel_error(packed[:, start : start + n], alone) <= TOL
            start += n
        model.configure_kernels(KernelOptions())
        unwindowed = model(ids, None, segments)
    assert rel_error(packed, unwindowed) > 1e-3


def test_configure_kernels_sets_every_attention_layer_and_refuses_what_cannot_run() -> None:
    for family in ("qwen3", "deepseek_v3", "gpt_oss", "qwen3_next", "minimax_m2", "step3p5"):
        model = _build(family)
        model.configure_kernels(KernelOptions(pre_tokens=PRE))
        attention = [m for m in model.modules() if isinstance(m, AttentionBase)]
        assert attention and all(m.pre_tokens == PRE for m in attention), family
    with pytest.raises(ValueError, match=r"kernels\.pre_tokens: mamba3 has no attention layers"):
        _build("mamba3").configure_kernels(KernelOptions(pre_tokens=PRE))
    with pytest.raises(
        ValueError, match=r"kernels\.use_flash_attn: true: .*takes no window.*pre_tokens \(3\)"
    ):
        _build("qwen3").configure_kernels(
            KernelOptions(pre_tokens=PRE, flash_attn=True, flash_attn_strict=True)
        )


def test_step3p5_layers_apply_the_window() -> None:
    model = _build("step3p5").to(torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)
        model.configure_kernels(KernelOptions(pre_tokens=PRE))
        windowed = model(ids)
        # The first PRE + 1 positions see every earlier token either way.
        assert rel_error(windowed[:, : PRE + 1], full[:, : PRE + 1]) <= 1e-12
    assert rel_error(windowed, full) > 1e-3


def test_the_config_reads_pre_tokens_and_refuses_later_tokens() -> None:
    base = {
        "model": {"model_type": "qwen3"},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
    }
    cfg = config_from_dict({**base, "kernels": {"pre_tokens": 4}})
    options = resolve_kernel_options(cfg.kernels, device=torch.device("cpu"), compute_dtype=torch.float32)
    assert options.pre_tokens == 4
    default = config_from_dict(base).kernels
    assert (
        resolve_kernel_options(default, device=torch.device("cpu"), compute_dtype=torch.float32).pre_tokens
        is None
    )
    with pytest.raises(
        ConfigError, match=r"kernels\.next_tokens.*must be 0 for causal LM training.*would see"
    ):
        config_from_dict({**base, "kernels": {"next_tokens": 1}})


def test_families_without_configure_kernels_refuse_the_window() -> None:
    from meshforge.models.common.kernels import configure_model_kernels

    with pytest.raises(ValueError, match=r"kernels\.pre_tokens: not supported by the generic model family"):
        configure_model_kernels(nn.Linear(2, 2), KernelOptions(pre_tokens=PRE), family="generic")


def test_the_cp_plan_gets_the_narrower_window_in_its_own_rule() -> None:
    # The CP plan takes transformers' window (i - window < j <= i): pre_tokens p is window p + 1.
    calls: list[dict[str, object]] = []

    def plan(q, k, v, mask, **kw):
        calls.append(kw)
        return torch.zeros_like(q)

    q = k = v = torch.zeros(1, 2, 4, 8)
    for window, pre_tokens, expected in ((None, 3, 4), (8, 3, 4), (3, 5, 3), (6, None, 6)):
        calls.clear()
        attend(q, k, v, object(), scale=0.3, cp=plan, window=window, pre_tokens=pre_tokens)
        assert calls[0]["window"] == expected, (window, pre_tokens, calls)
    calls.clear()
    attend(q, k, v, object(), scale=0.3, cp=plan)
    assert calls == [{"scale": 0.3}]


def test_strict_flash_refuses_a_window_and_auto_runs_masked_sdpa() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, SEQ, 8, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match=r"kernels\.use_flash_attn: true: .*takes no window"):
        attend(q, k, v, None, scale=0.3, flash=True, flash_strict=True, pre_tokens=PRE)
    got = attend(q, k, v, None, scale=0.3, flash=True, pre_tokens=PRE)
    assert rel_error(got, _reference(q, k, v, band(SEQ, SEQ, PRE), 0.3)) <= TOL
