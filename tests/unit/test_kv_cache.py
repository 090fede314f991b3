"""The generation caches one by one: what each layer kind keeps, reordering, and the MLA memory.

Token equality with transformers' generate for every family is in ``test_generate.py`` and
``test_beam_search.py``; these tests look inside the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import assert_close
from tests.unit._generate_fixtures import PROMPTS, save_family

transformers = pytest.importorskip("transformers")


def _load(folder: Path) -> torch.nn.Module:
    from meshforge.config import load_config
    from meshforge.infer.load import load_generation_model

    config = folder.parent / f"{folder.name}.yaml"
    config.write_text(f"context:\n  device_target: cpu\nmodel:\n  model_name_or_path: {folder}\n")
    return load_generation_model(load_config(str(config), []), torch.device("cpu"), lambda _m: None).model


def _prompts(folder: Path) -> list[list[int]]:
    from meshforge.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(folder))
    return [tokenizer(t)["input_ids"] for t in PROMPTS]


def _run(model: torch.nn.Module, prompts: list[list[int]], new: int, **options: bool):
    """Greedy decode of ``new`` tokens through a :class:`Stepper`; returns (tokens, stepper)."""
    from meshforge.infer.engine import DecodeRequest, Stepper, left_pad

    request = DecodeRequest(prompts, new, 0, (), **options)
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    stepper = Stepper(model, ids, mask, request)
    tokens = []
    with torch.no_grad():
        for _ in range(new):
            token = stepper.logits().argmax(-1)
            tokens.append(token)
            stepper.append(token)
    return torch.stack(tokens, 1).tolist(), stepper


def test_sliding_layer_keeps_only_its_window(tmp_path: Path) -> None:
    from meshforge.infer.kv_cache import _WindowCache

    folder = save_family(tmp_path / "gpt_oss", "gpt_oss")  # layer 0 slides (window 3), layer 1 is full
    model = _load(folder)
    prompts = _prompts(folder)
    _, stepper = _run(model, prompts, 4)
    cache = stepper.cache
    assert cache is not None
    sliding, full = cache.layers
    assert isinstance(sliding, _WindowCache) and not isinstance(full, _WindowCache)
    assert sliding.k is not None and full.k is not None
    # After the last forward: 3 slots held by the sliding layer, every slot by the full layer.
    assert sliding.k.shape[2] == 3
    assert full.k.shape[2] == cache.capacity and cache.length == max(map(len, prompts)) + 3
    # Attending only those keys gives the tokens of the whole-sequence forward.
    tokens, _ = _run(model, prompts, 4)
    uncached, _ = _run(model, prompts, 4, use_kv_cache=False)
    assert tokens == uncached


def test_deltanet_state_continues_the_rule() -> None:
    """The chunked rule entered with the state of a prefix equals the rule over the whole row."""
    from meshforge.models.qwen3_next.gdn import _chunk_rule, _recurrent_rule, recurrent_gated_delta_rule

    torch.manual_seed(0)
    batch, seq, hk, hv, dk, dv = 2, 11, 2, 4, 8, 6
    q, k = torch.randn(batch, seq, hk, dk), torch.randn(batch, seq, hk, dk)
    v = torch.randn(batch, seq, hv, dv)
    g, beta = -torch.rand(batch, seq, hv), torch.rand(batch, seq, hv)
    whole = recurrent_gated_delta_rule(q, k, v, g, beta)
    cut = 7
    head, state = _chunk_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], chunk_size=4)
    outs = [head]
    for t in range(cut, seq):
        out, state = _recurrent_rule(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            initial_state=state,
        )
        outs.append(out)
    assert_close(torch.cat(outs, 1), whole)
    _, final = _recurrent_rule(q, k, v, g, beta)
    assert_close(state, final)


def test_reorder_moves_every_layer_kind(tmp_path: Path) -> None:
    """Reordered rows continue as the rows they copy (the beam search's cache pluck)."""
    from meshforge.infer.engine import DecodeRequest, Stepper, left_pad

    folder = save_family(tmp_path / "qwen3_next", "qwen3_next")  # DeltaNet layer + attention layer
    model = _load(folder)
    prompts = _prompts(folder)
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    index = torch.tensor([2, 2, 0])
    logits = []
    for reorder in (False, True):
        stepper = Stepper(model, ids, mask, DecodeRequest(prompts, 4, 0, ()))
        with torch.no_grad():
            token = stepper.logits().argmax(-1)
            if reorder:
                stepper.reorder(index)
                token = token[index]
            stepper.append(token)
            logits.append(stepper.logits())
        assert stepper.cache is not None
        assert len(stepper.cache.states) == 1 and len(stepper.cache.layers) == 1
    plain, moved = logits
    assert_close(moved, plain[index])
    assert not torch.allclose(plain[0], plain[2])  # the rows really differ


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family(tmp_path_factory.mktemp("mla") / "deepseek_v3", "deepseek_v3")


def test_mla_compressed_cache_tokens_and_memory(deepseek: Path) -> None:
    model = _load(deepseek)
    prompts = _prompts(deepseek)
    compressed, small = _run(model, prompts, 6)
    full, large = _run(model, prompts, 6, compressed_mla=False)
    assert compressed == full
    assert small.cache is not None and large.cache is not None
    args = model.config
    heads = args.num_attention_heads
    per_token_full = heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    per_token_latent = args.kv_lora_rank + args.qk_rope_head_dim
    slots = len(prompts) * small.cache.capacity * args.num_hidden_layers * 4  # float32
    assert small.cache.nbytes() == slots * per_token_latent
    assert large.cache.nbytes() == slots * per_token_full
