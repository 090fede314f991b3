"""Built-in MiniMax-M2 against transformers' MiniMaxM2ForCausalLM: logits, loss, aux loss,
gradients, routing by the correction bias, packing, the safetensors adapter and HF folders, args."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.minimax_m2.args import FLAVORS, MiniMaxM2Args, from_options  # noqa: E402
from meshforge.models.minimax_m2.model import MiniMaxM2ForCausalLM, build_minimax_m2  # noqa: E402
from meshforge.models.minimax_m2.spec import FAMILY  # noqa: E402
from tests.unit._parity import load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=24,
    max_position_embeddings=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    # Half-rotary heads (as published), 6 experts top-2, untied, aux loss on.
    "partial_rope_aux": MiniMaxM2Args(
        **SMALL,
        num_hidden_layers=2,
        rotary_dim=6,
        num_local_experts=6,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    # Fully rotated heads, tied head, top-3 of 4, no aux loss, another theta.
    "full_rope_tied": MiniMaxM2Args(
        **SMALL,
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
    ),
}


def _hf_model(args: MiniMaxM2Args, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.MiniMaxM2Config(**args.to_hf_dict())
    config._attn_implementation = "sdpa"
    hf = transformers.MiniMaxM2ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)  # sharper routing: clear-cut top-k choices
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)  # large enough to change which experts are chosen
    return hf


def _pair(args: MiniMaxM2Args, seed: int = 0):
    hf = _hf_model(args, seed)
    ours = MiniMaxM2ForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_aux_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == args.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids, output_router_logits=args.output_router_logits)
    out = ours(ids)
    assert out.shape == ref.logits.shape == (2, 29, args.vocab_size)
    assert _rel(out, ref.logits) <= 1e-4
    aux = ours.aux_loss()
    if args.output_router_logits:
        assert aux is not None and _rel(aux, ref.aux_loss) <= 1e-5
    else:
        assert aux is None

    losses = {}
    for key, logits, extra in (("hf", ref.logits, ref.aux_loss), ("ours", out, aux)):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        if extra is not None:
            loss = loss + args.router_aux_loss_coef * extra
        loss.backward()
        losses[key] = loss.detach()
    assert _rel(losses["ours"], losses["hf"]) <= 1e-5
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    trainable = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trainable) == len(hf_grads)
    for n, p in trainable:
        assert p.grad is not None, n
        assert _rel(p.grad, hf_grads[n]) <= 1e-4, n
    frozen = [n for n, p in ours.named_parameters() if not p.requires_grad]
    assert frozen == [f"model.layers.{i}.mlp.e_score_correction_bias" for i in range(args.num_hidden_layers)]


def test_routing_follows_the_correction_bias_and_weights_are_unbiased_scores():
    args = CONFIGS["partial_rope_aux"]
    _, ours = _pair(args, seed=2)
    block = ours.model.layers[0].mlp
    x = torch.randn(40, args.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        block.e_score_correction_bias.zero_()
        block.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's choice
        _, weights, indices = block.gate(x, block.e_score_correction_bias)
        assert (indices == 5).any(dim=-1).all()
        scores = torch.sigmoid(x @ block.gate.weight.T)
        chosen = scores.gather(1, indices)
        assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True))
        block.gate.fixed = True
        _, _, fixed = block.gate(x, block.e_score_correction_bias)
        counts = torch.bincount(fixed.reshape(-1), minlength=6)
        assert int(counts.max() - counts.min()) <= 1


def test_packed_documents_equal_separate_runs():
    args = CONFIGS["partial_rope_aux"]
    _, ours = _pair(args, seed=4)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 96, (1, 11), generator=gen), torch.randint(0, 96, (1, 7), generator=gen)
    packed = torch.cat([a, b], dim=1)
    segments = torch.tensor([[1] * 11 + [2] * 7])
    with torch.no_grad():
        out = ours(packed, segment_ids=segments)
        assert _rel(out[:, :11], ours(a)) <= 1e-5
        assert _rel(out[:, 11:], ours(b)) <= 1e-5


def test_padding_is_left_out_of_the_aux_loss_as_transformers_does():
    args = CONFIGS["partial_rope_aux"]
    hf, ours = _pair(args, seed=7)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
        out = ours(ids, segment_ids=mask)
    assert _rel(out[mask.bool()], ref.logits[mask.bool()]) <= 1e-4
    assert _rel(ours.aux_loss(), ref.aux_loss) <= 1e-5


def test_bfloat16_parameters_train():
    model = build_minimax_m2(FLAVORS["debug"], device="cpu").to(torch.bfloat16)
    logits = model(torch.randint(0, 8192, (2, 9)))
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
    )


@pytest.mark.parametrize("tied", [False, True])
def test_hf_adapter_round_trip_against_save_pretrained(tmp_path, tied):
    from safetensors.torch import load_file

    args = replace(CONFIGS["partial_rope_aux"], tie_word_embeddings=tied)
    hf = _hf_model(args, seed=6)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in saved)
    memory = hf.state_dict()
    ours = MiniMaxM2ForCausalLM(args)
    adapter = FAMILY.hf_adapter(args)
    for name, _ in ours.named_parameters():
        tensor = adapter.from_hf(name, {k: saved[k] for k in adapter.hf_sources(name)})
        assert torch.equal(tensor, memory[name]), name
    ours.load_state_dict(memory)
    written = {}
    for name, param in ours.named_parameters():
        for key, tensor in adapter.to_hf(name, param.detach()).items():
            assert key not in written, key
            written[key] = tensor
    assert set(written) == set(saved) - ({"lm_head.weight"} if tied else set())
    for key, tensor in written.items():
        assert torch.equal(tensor, saved[key]), key


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_loads_and_exports_with_transformers_logits(tied: bool, tmp_path: Path) -> None:
    from meshforge.checkpoint.hf import hf_adapter as family_adapter
    from meshforge.checkpoint.hf import load_hf_weights, read_hf_config, save_hf

    args = replace(CONFIGS["partial_rope_aux"], tie_word_embeddings=tied)
    reference = _hf_model(args, seed=8).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src, max_shard_size="50KB")

    options = family_adapter(FAMILY).from_hf_config(read_hf_config(src))
    model = FAMILY.build(options, device="meta")
    assert model.args.attn_rotary_dim == 6 and model.args.theta == args.theta
    model.to_empty(device="cpu")
    load_hf_weights(model, FAMILY, src)
    model.eval()

    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        assert _rel(model(ids), expected) <= 1e-4
        out = tmp_path / "export"
        save_hf(model, FAMILY, out)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(reloaded).__name__ == "MiniMaxM2ForCausalLM"
        assert _rel(reloaded(ids).logits, expected) <= 1e-4


def test_published_config_json_maps_and_variants_are_refused():
    from meshforge.models.minimax_m2.hf import from_hf_config

    # The fields of MiniMaxAI/MiniMax-M2's config.json that shape the model (weights in bf16).
    published = {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "head_dim": 128,
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "num_hidden_layers": 62,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "rotary_dim": 64,
        "rope_theta": 5_000_000,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "shared_intermediate_size": 0,
        "vocab_size": 200064,
        "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6,
    }
    args = from_options(from_hf_config(published))
    assert args.attn_rotary_dim == 64 and args.theta == 5e6 and args.num_local_experts == 256
    model = build_minimax_m2(args, device="meta")
    total, active = model.num_params(), model.num_params(exclude_embedding=True, active=True)
    assert 228e9 < total < 231e9 and 9.5e9 < active < 10.5e9  # 229B total, 10B active
    for key, value in (
        ("scoring_func", "softmax"),
        ("use_routing_bias", False),
        ("shared_intermediate_size", 8),
    ):
        with pytest.raises(ValueError, match=f"config.json {key}: not supported yet"):
            from_hf_config({**published, key: value})
    with pytest.raises(ValueError, match="quantization_config: not supported yet"):
        from_hf_config({**published, "quantization_config": {"quant_method": "fp8"}})


def test_args_refuse_bad_values_by_name():
    assert from_options({"flavor": "debug", "num_experts": 8}).num_local_experts == 8
    bad = {
        "num_local_expert": (4, "did you mean 'num_local_experts'"),
        "num_key_value_heads": (3, "num_key_value_heads: must divide"),
        "num_experts_per_tok": (9, "num_experts_per_tok: must be at most"),
        "rotary_dim": (5, "rotary_dim: .* must be a positive even number"),
        "router_jitter_noise": (0.1, "router_jitter_noise: not supported yet"),
        "rope_parameters": ({"rope_type": "yarn", "factor": 4.0}, "not supported yet"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            from_options({"flavor": "debug", key: value})


def test_init_meta_build_and_counts():
    model = build_minimax_m2(FLAVORS["debug"], device="meta")
    assert all(p.is_meta for p in model.parameters())
    real = build_minimax_m2(FLAVORS["debug"], device="cpu")
    block = real.model.layers[1].mlp
    assert torch.equal(block.e_score_correction_bias, torch.zeros(4))
    assert real.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    assert 0.015 < float(block.experts.gate_up_proj.detach().std()) < 0.025
    with pytest.raises(ValueError, match="not a MiniMax-M2 parameter"):
        real.init_full_parameter_("model.foo", torch.empty(1), torch.Generator())
    assert real.num_params(active=True) < real.num_params()
    assert real.flops_per_token(64) > 6 * real.num_params(exclude_embedding=True, active=True) * 0.5


def test_registry_resolves_the_family_by_type_architecture_and_mindspeed_id(tmp_path):
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict
    from meshforge.models.registry import check_model_options, resolve_family

    assert resolve_family(model_type="minimax_m2") is FAMILY
    assert resolve_family(architectures=["MiniMaxM2ForCausalLM"]) is FAMILY
    assert resolve_family(model_id="minimax_m27") is FAMILY
    assert check_model_options("minimax_m2", None, None, {"num_local_experts": 8}) == []
    assert check_model_options("minimax_m2", None, None, {"num_local_expert": 8})[0][0] == "num_local_expert"
    _hf_model(CONFIGS["full_rope_tied"], seed=9).save_pretrained(tmp_path)
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(tmp_path)}}).model
    source = resolve_model_source(model_cfg)
    assert source.family.name == "minimax_m2"
    assert source.family.parse_options(source.options).num_local_experts == 4


def test_tiny_config_model_section_builds():
    import yaml

    from meshforge.models.minimax_m2.args import OPTION_KEYS

    path = Path(__file__).resolve().parents[2] / "configs" / "minimax_m2" / "tiny.yaml"
    section = yaml.safe_load(path.read_text())["model"]
    assert section["model_type"] == FAMILY.name
    options = {k: v for k, v in section.items() if k in OPTION_KEYS}
    assert FAMILY.parse_options(options) == FLAVORS["tiny"]
    model = build_minimax_m2(FLAVORS["tiny"], device="cpu")
    logits = model(torch.randint(0, 8192, (1, 6)))
    assert torch.isfinite(logits).all() and sorted(model.tokens_per_expert()) == [0, 1, 2, 3]
