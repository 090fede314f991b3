"""Meta-device models become real, runnable, reproducibly initialised modules."""

from __future__ import annotations

import torch

from meshforge.models.materialize import materialize_and_init, parameter_seed
from meshforge.models.registry import resolve_family

OPTIONS = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def _build(tied: bool, seed: int = 3) -> torch.nn.Module:
    family = resolve_family("qwen3", None, None)
    with torch.device("meta"):
        model = family.build(dict(OPTIONS, tie_word_embeddings=tied))
    materialize_and_init(model, device=torch.device("cpu"), seed=seed, init_fn=model.init_full_parameter_)
    return model


def test_tied_embeddings_stay_tied_and_the_model_runs() -> None:
    model = _build(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256) and torch.isfinite(logits).all()


def test_untied_model_has_its_own_head_and_init_is_reproducible() -> None:
    a, b = _build(tied=False), _build(tied=False)
    assert a.lm_head.weight is not a.model.embed_tokens.weight
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = _build(tied=False, seed=4)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_parameter_seed_is_stable_and_distinct() -> None:
    assert parameter_seed(1, "a.weight") == parameter_seed(1, "a.weight")
    assert parameter_seed(1, "a.weight") != parameter_seed(2, "a.weight")
    assert parameter_seed(1, "a.weight") != parameter_seed(1, "b.weight")
