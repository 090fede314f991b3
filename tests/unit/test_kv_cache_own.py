"""The caches of minimax_m2, step3p5 and mamba3 against the whole-sequence forward, no transformers.

Each family's tiny model is built from its own args (``own_only_args`` and a MiniMax-M2 one): two
prompts of different lengths in one left-padded batch, every cached step's logits against the
training forward of the whole sequence (what ``use_kv_cache: false`` runs), and greedy, sampled
(seeded) and beam-searched tokens with the cache equal to those without. minimax_m2's tokens are
also compared with transformers' generate in ``test_generate.py``; the other two have no
transformers model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshforge.infer.beam import BeamOptions, beam_search
from meshforge.infer.engine import DecodeRequest, Stepper, decode, left_pad
from meshforge.infer.kv_cache import cache_support
from meshforge.infer.sampling import SamplingOptions
from meshforge.models.minimax_m2.args import MiniMaxM2Args
from meshforge.models.registry import SPECS
from tests._compare import assert_close
from tests.unit._generate_fixtures import own_only_args

TINY: dict[str, object] = {
    "minimax_m2": MiniMaxM2Args(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rotary_dim=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
    ),
    **own_only_args(),
}
FAMILIES = sorted(TINY)
NEW = 6  # new tokens per row
PAD = 0


def _tiny(family: str) -> nn.Module:
    """The family's tiny model, float32, with weights far from their init (sharp logits)."""
    spec = next(s for s in SPECS if s.name == family)
    torch.manual_seed(0)
    model = spec.builder(TINY[family], "cpu")  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 if p.dim() > 1 else p + noise * 0.2)
    return model.eval()


def _prompts() -> list[list[int]]:
    """Seven and three tokens: the second row is left-padded; seven passes the sliding window (4)
    and the mamba3 chunk (4)."""
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (7, 3)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, _tiny(request.param)


def test_the_three_families_have_a_cache(family_model: tuple[str, nn.Module]) -> None:
    _, model = family_model
    assert cache_support(model) is None


@torch.no_grad()
def test_each_cached_step_equals_the_whole_sequence_forward(family_model: tuple[str, nn.Module]) -> None:
    _, model = family_model
    prompts = _prompts()
    ids, mask = left_pad(prompts, PAD, torch.device("cpu"))
    cached = Stepper(model, ids, mask, DecodeRequest(prompts, NEW, PAD, ()))
    whole = Stepper(model, ids, mask, DecodeRequest(prompts, NEW, PAD, (), use_kv_cache=False))
    assert cached.cache is not None and whole.cache is None
    for step in range(NEW):
        want = whole.logits()
        assert_close(cached.logits(), want, what=step)
        token = want.argmax(-1)
        whole.append(token)
        cached.append(token)
    assert cached.cache.length == ids.shape[1] + NEW - 1


SAMPLINGS = {
    "greedy": SamplingOptions(),
    "sampled": SamplingOptions(do_sample=True, temperature=0.9, top_k=40, top_p=0.95),
}


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_tokens_with_the_cache_equal_those_without(
    family_model: tuple[str, nn.Module], sampling: str
) -> None:
    _, model = family_model
    prompts = _prompts()
    rows = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(5)
        request = DecodeRequest(prompts, NEW, PAD, (), use_kv_cache=use_cache)
        rows.append(decode(model, request, SAMPLINGS[sampling], generator=gen))
    assert rows[0] == rows[1]
    assert [len(r) for r in rows[0]] == [NEW, NEW]


def test_beam_search_with_the_cache_equals_without(family_model: tuple[str, nn.Module]) -> None:
    _, model = family_model
    prompts = _prompts()
    beams = [
        beam_search(model, DecodeRequest(prompts, NEW, PAD, (), use_kv_cache=c), BeamOptions(3))
        for c in (True, False)
    ]
    greedy = decode(model, DecodeRequest(prompts, NEW, PAD, ()), SamplingOptions())
    assert beams[0] == beams[1]
    assert beams[0] != greedy  # the beams change the answer: the cache's reordering is exercised


@torch.no_grad()
def test_what_each_layer_keeps(family_model: tuple[str, nn.Module]) -> None:
    """step3p5's sliding layer holds its window, the full one every slot; mamba3 holds states only."""
    from meshforge.infer.kv_cache import _WindowCache

    family, model = family_model
    prompts = _prompts()
    ids, mask = left_pad(prompts, PAD, torch.device("cpu"))
    stepper = Stepper(model, ids, mask, DecodeRequest(prompts, 3, PAD, ()))
    for _ in range(3):
        stepper.append(stepper.logits().argmax(-1))
    cache = stepper.cache
    assert cache is not None
    args = TINY[family]
    if family == "mamba3":
        assert not cache.layers and len(cache.states) == 2
        h, p, n, a = args.num_heads, args.head_dim, args.state_size, args.num_rope_angles  # type: ignore[attr-defined]
        assert cache.nbytes() == 2 * len(prompts) * (2 * h * p * n + h * a) * 4
        return
    kinds = [isinstance(layer, _WindowCache) for layer in cache.layers]
    assert kinds == ([False, True] if family == "step3p5" else [False, False])
    for layer, windowed in zip(cache.layers, kinds, strict=True):
        assert layer.k is not None
        assert layer.k.shape[2] == (args.sliding_window if windowed else cache.capacity)  # type: ignore[attr-defined]


def test_mamba3_prompt_state_continues_the_recurrence() -> None:
    """The closed-form state after a prompt, continued token by token, gives the whole row's scan."""
    from meshforge.models.mamba3.scan import continue_scan, final_state, recurrent_scan

    torch.manual_seed(0)
    batch, seq, rank, heads, n, p = 2, 9, 2, 3, 4, 5
    q, k = torch.randn(batch, seq, rank, heads, n), torch.randn(batch, seq, rank, heads, n)
    v = torch.randn(batch, seq, rank, heads, p)
    adt, dt, lam = (
        -torch.rand(batch, seq, heads),
        torch.rand(batch, seq, heads),
        torch.rand(batch, seq, heads),
    )
    doc = torch.tensor([[0] * seq, [0, 0, 1, 1, 1, 1, 1, 1, 1]])  # the second row starts at token 2
    whole = recurrent_scan(q, k, v, adt, dt, lam, doc)
    cut = 6
    state, look_back = final_state(
        k[:, :cut], v[:, :cut], adt[:, :cut], dt[:, :cut], lam[:, :cut], doc[:, :cut]
    )
    rest, state, look_back = continue_scan(
        q[:, cut:], k[:, cut:], v[:, cut:], adt[:, cut:], dt[:, cut:], lam[:, cut:], state, look_back
    )
    assert_close(rest, whole[:, cut:])
    # Continued to the end, the state is the closed form of the whole row.
    assert_close(state, final_state(k, v, adt, dt, lam, doc)[0])
    # The state of the second row's document alone: nothing of its padding document leaks in.
    alone, _ = final_state(k[1:, 2:], v[1:, 2:], adt[1:, 2:], dt[1:, 2:], lam[1:, 2:])
    full, _ = final_state(k[1:], v[1:], adt[1:], dt[1:], lam[1:], doc[1:])
    assert_close(full, alone)


def test_a_window_in_a_one_mask_decoder_is_refused() -> None:
    """One mask per forward cannot serve a full and a windowed layer: the cache says so."""
    spec = next(s for s in SPECS if s.name == "minimax_m2")
    with torch.device("meta"):
        model = spec.builder(TINY["minimax_m2"], "meta")  # type: ignore[arg-type]
    assert cache_support(model) is None
    model.model.layers[1].self_attn.sliding_window = 3
    reason = cache_support(model)
    assert reason is not None and "sliding-window layer in a decoder that takes one mask" in reason
