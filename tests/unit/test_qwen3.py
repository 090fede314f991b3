"""Built-in Qwen3 against transformers' Qwen3ForCausalLM, plus init and registry checks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.attention import positions_from_segments  # noqa: E402
from meshforge.models.qwen3.args import FLAVORS, Qwen3Args, from_options  # noqa: E402
from meshforge.models.qwen3.model import Qwen3ForCausalLM, build_qwen3  # noqa: E402
from meshforge.models.registry import (  # noqa: E402
    build_model,
    check_model_options,
    resolve_family,
)
from tests.unit._parity import assert_grads_match, load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rope_theta=10_000.0,
)
CONFIGS = {
    # GQA, untied head, head_dim unrelated to hidden/heads.
    "gqa_untied": Qwen3Args(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=12),
    # MHA, tied head, head_dim larger than hidden/heads.
    "mha_tied": Qwen3Args(
        **SMALL, num_attention_heads=2, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True
    ),
    # MQA with attention bias and a padding id.
    "mqa_bias": Qwen3Args(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=8, attention_bias=True, pad_token_id=0
    ),
}


def _pair(args: Qwen3Args, seed: int = 0):
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3Config(**args.to_hf_dict())
    hf_config._attn_implementation = "sdpa"
    hf = transformers.Qwen3ForCausalLM(hf_config).float()
    # Biases are zero at init; randomise them so the parity test sees them.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ours = Qwen3ForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    if args.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    else:
        assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 37), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 37), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids).logits
    out = ours(ids)
    assert out.shape == ref.shape == (2, 37, args.vocab_size)
    assert _rel(out, ref) <= 1e-5

    for model, logits in ((hf, ref), (ours, out)):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        model._test_loss = loss.detach()
    assert _rel(ours._test_loss, hf._test_loss) <= 1e-5
    assert_grads_match(hf, ours, tol=1e-5)


def test_position_ids_are_honoured():
    args = CONFIGS["gqa_untied"]
    hf, ours = _pair(args, seed=3)
    ids = torch.randint(0, args.vocab_size, (2, 20))
    positions = torch.stack([torch.arange(20) + 7, torch.arange(20) * 2 + 1])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=positions).logits
        out = ours(ids, position_ids=positions)
        default = ours(ids)
    assert _rel(out, ref) <= 1e-5
    assert _rel(out, default) > 1e-3  # positions actually change the result


def test_packed_documents_equal_separate_runs():
    args = CONFIGS["mha_tied"]
    _, ours = _pair(args, seed=4)
    lengths = [7, 12, 5]
    docs = [torch.randint(0, args.vocab_size, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    segment_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, segment_ids=segment_ids)[0]
        start = 0
        for doc in docs:
            alone = ours(doc[None])[0]
            assert _rel(out[start : start + len(doc)], alone) <= 1e-5
            start += len(doc)


def test_padding_segment_gives_no_nan_and_does_not_leak():
    args = CONFIGS["gqa_untied"]
    _, ours = _pair(args, seed=5)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    segment_ids = torch.tensor([[1] * 10 + [0] * 6, [0] * 3 + [1] * 8 + [2] * 5])
    out = ours(ids, segment_ids=segment_ids)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
    with torch.no_grad():
        alone = ours(ids[:1, :10])
        # Leading padding must not change the document after it (positions restart).
        second = ours(ids[1:, 3:11])
    assert _rel(out[0, :10].detach(), alone[0]) <= 1e-5
    assert _rel(out[1, 3:11].detach(), second[0]) <= 1e-5


def test_positions_from_segments():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [0, 1, 1, 1, 3, 3, 3]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 0, 1, 2, 0, 1, 2]])
    assert torch.equal(positions_from_segments(seg), expected)


def test_init_full_parameter_statistics_and_determinism():
    args = from_options({"flavor": "tiny", "pad_token_id": 3, "tie_word_embeddings": False})
    model = build_qwen3(args, device="meta")

    def draw(fqn: str, seed: int) -> torch.Tensor:
        shape = dict(model.named_parameters())[fqn].shape
        t = torch.empty(shape)
        model.init_full_parameter_(fqn, t, torch.Generator().manual_seed(seed))
        return t

    w = draw("model.layers.1.mlp.up_proj.weight", 7)
    assert abs(w.mean().item()) < 2e-4
    assert abs(w.std().item() - args.initializer_range) < 2e-4
    assert torch.equal(w, draw("model.layers.1.mlp.up_proj.weight", 7))
    assert not torch.equal(w, draw("model.layers.1.mlp.up_proj.weight", 8))
    emb = draw("model.embed_tokens.weight", 1)
    assert torch.count_nonzero(emb[3]) == 0 and torch.count_nonzero(emb[4]) == args.hidden_size
    assert torch.equal(draw("model.layers.0.self_attn.q_norm.weight", 0), torch.ones(args.head_dim))
    assert torch.equal(draw("model.norm.weight", 0), torch.ones(args.hidden_size))
    head = draw("lm_head.weight", 2)
    assert abs(head.std().item() - args.initializer_range) < 2e-4
    with pytest.raises(ValueError, match="not a Qwen3 parameter"):
        model.init_full_parameter_("model.rotary_emb.inv_freq", torch.empty(2), torch.Generator())


def test_build_on_device_inits_every_parameter():
    model = build_qwen3(FLAVORS["debug"], device="cpu")
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.std() > 0.01, name
    ids = torch.randint(0, FLAVORS["debug"].vocab_size, (1, 8))
    assert model(ids).shape == (1, 8, FLAVORS["debug"].vocab_size)


def test_flavor_tiny_size():
    model = build_model("qwen3", {"flavor": "tiny"})
    assert next(model.parameters()).device.type == "meta"
    assert 3_000_000 < model.num_params() < 8_000_000
    assert model.args.tie_word_embeddings and model.args.head_dim == 64


def test_registry_resolves_by_every_name():
    assert resolve_family(model_type="qwen3").name == "qwen3"
    assert resolve_family(architectures="Qwen3ForCausalLM").name == "qwen3"
    assert resolve_family(architectures=["Other", "Qwen3ForCausalLM"]).name == "qwen3"
    assert resolve_family(model_id="qwen3").name == "qwen3"
    with pytest.raises(ValueError, match="not supported yet: model family.*mamba9.*built: .*qwen3"):
        resolve_family(model_type="mamba9")
    with pytest.raises(ValueError, match="no model family"):
        resolve_family()


def test_option_check_suggests_close_key():
    problems = check_model_options(
        "qwen3", None, None, {"num_hiden_layers": 2, "flavor": "tiny", "head_dim": 8}
    )
    assert problems == [("num_hiden_layers", "not a qwen3 model option; did you mean 'num_hidden_layers'?")]
    [(key, reason)] = check_model_options(None, "Mamba9ForCausalLM", None, {})
    assert key == "architectures"
    assert reason.startswith("not supported yet: model family 'Mamba9ForCausalLM'; built: ")
    assert "qwen3" in reason
    with pytest.raises(ValueError, match="num_hiden_layers.*did you mean 'num_hidden_layers'"):
        from_options({"num_hiden_layers": 2})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        from_options({"flavor": "tiny", "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="flavor"):
        from_options({"flavor": "huge"})
    with pytest.raises(ValueError, match="rope_type"):
        from_options({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_rope_parameters_spelling_matches_transformers():
    args = from_options({"flavor": "debug", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert args.theta == 5e5
    assert from_options({"flavor": "debug", "rope_theta": 123.0}).theta == 123.0
    hf_config = transformers.Qwen3Config(**args.to_hf_dict())
    assert hf_config.rope_parameters["rope_theta"] == 5e5


def test_options_accept_yaml_number_spellings_but_not_bools():
    args = from_options(
        {"flavor": "debug", "rms_norm_eps": "1e-5", "num_hidden_layers": "3", "rope_theta": 5}
    )
    assert (args.rms_norm_eps, args.num_hidden_layers, args.theta) == (1e-5, 3, 5.0)
    for bad, key in (
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"vocab_size": float("inf")}, "vocab_size"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"hidden_size": 0}, "hidden_size"),
    ):
        with pytest.raises(ValueError, match=key):
            from_options({"flavor": "debug", **bad})


@pytest.mark.procs
def test_config_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from meshforge.models.registry import check_model_options, resolve_family; "
        "resolve_family('qwen3').parse_options({'flavor': 'tiny'}); "
        "check_model_options('qwen3', None, None, {'x': 1}); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_meta_build_then_materialise_matches_direct_build():
    """The trainer's path: meta -> to_empty -> init each full parameter from its own seed."""
    direct = build_qwen3(FLAVORS["debug"], device="cpu")
    lazy = build_model("qwen3", {"flavor": "debug"})
    lazy.to_empty(device="cpu")
    for i, (name, param) in enumerate(lazy.named_parameters()):
        lazy.init_full_parameter_(name, param.data, torch.Generator().manual_seed(i))
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    for (name, a), (_, b) in zip(direct.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 12))
    assert torch.equal(direct(ids), lazy(ids))


def test_config_alias_exposes_args():
    model = build_model("qwen3", {"flavor": "tiny"})
    assert model.config is model.args and model.config.vocab_size == 8192
