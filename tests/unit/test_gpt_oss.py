"""Built-in gpt-oss against transformers' GptOssForCausalLM: logits, loss, aux loss, gradients,
sliding/full attention with sinks, YaRN, routing counts, packing, the HF folder round trip,
args and init."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.sink_attention import causal_mask, sliding_window_mask  # noqa: E402
from meshforge.models.common.yarn import yarn_from_parameters  # noqa: E402
from meshforge.models.gpt_oss.args import FLAVORS, GptOssArgs, from_options  # noqa: E402
from meshforge.models.gpt_oss.model import GptOssForCausalLM, build_gpt_oss  # noqa: E402
from meshforge.models.gpt_oss.spec import FAMILY  # noqa: E402
from tests.unit._parity import assert_grads_match, load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=16,
    max_position_embeddings=256,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    # Sliding / full / sliding, window 5 < sequence 29, GQA 4:2, untied, gpt-oss' default YaRN rope.
    "sliding_full_gqa_untied_yarn": GptOssArgs(
        **SMALL,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    # Full then sliding (explicit layer_types), MQA, tied, plain rope, head_dim != hidden / heads,
    # a small swiglu_limit so the clamps are active, top-3 of 4.
    "tied_mqa_default_rope_clamped": GptOssArgs(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention"],
        num_local_experts=4,
        num_experts_per_tok=3,
        swiglu_limit=0.5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ),
    # YaRN with truncation, positions beyond original_max_position_embeddings; no attention bias.
    "yarn_truncate_no_bias": GptOssArgs(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=7,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_bias=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 500.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "truncate": True,
        },
    ),
}


def _hf_model(args: GptOssArgs, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**args.to_hf_dict())
    hf = transformers.GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(("mlp.router.weight", "mlp.router.bias", "self_attn.sinks")):
                # Sharper routing than the 0.02 init (clear-cut top-k) and sinks that matter.
                p.normal_(0.0, 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.2)
            elif name.endswith(("bias", "_proj_bias")):
                p.normal_(0.0, 0.1)  # transformers zero-initialises these; make them count
    return hf


def _pair(args: GptOssArgs, seed: int = 0):
    hf = _hf_model(args, seed)
    ours = GptOssForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_aux_loss_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [
        layer.self_attn.sliding_window for layer in ours.model.layers
    ]
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == args.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids)
    out = ours(ids)
    assert out.shape == ref.logits.shape == (2, 29, args.vocab_size)
    assert _rel(out, ref.logits) <= 1e-4
    ours_aux = ours.aux_loss()
    assert ours_aux is not None and ref.aux_loss is not None
    assert _rel(ours_aux, ref.aux_loss) <= 1e-5

    coef = args.router_aux_loss_coef
    losses = {}
    for key, logits, aux in (("hf", ref.logits, ref.aux_loss), ("ours", out, ours_aux)):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") + coef * aux
        loss.backward()
        losses[key] = loss.detach()
    assert _rel(losses["ours"], losses["hf"]) <= 1e-5
    assert_grads_match(hf, ours, tol=1e-4)


def test_position_ids_are_honoured_like_transformers():
    args = CONFIGS["yarn_truncate_no_bias"]
    hf, ours = _pair(args, seed=3)
    ids = torch.randint(0, args.vocab_size, (1, 12))
    positions = torch.arange(40, 52)[None]
    with torch.no_grad():
        assert (
            _rel(ours(ids, position_ids=positions), hf(input_ids=ids, position_ids=positions).logits) <= 1e-4
        )


def test_tokens_per_expert_counts_transformers_router_picks():
    args = CONFIGS["sliding_full_gqa_untied_yarn"]
    hf, ours = _pair(args, seed=2)
    ids = torch.randint(0, args.vocab_size, (3, 17))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_router_logits=True)
        ours(ids)
    counts = ours.tokens_per_expert()
    assert sorted(counts) == list(range(args.num_hidden_layers))
    for i, router_logits in enumerate(ref.router_logits):
        picks = torch.topk(router_logits, args.num_experts_per_tok, dim=-1).indices
        expected = torch.bincount(picks.flatten(), minlength=args.num_local_experts)
        assert torch.equal(counts[i], expected)
        assert int(counts[i].sum()) == 3 * 17 * args.num_experts_per_tok


def test_packed_segments_equal_separate_documents_across_windows():
    args = CONFIGS["sliding_full_gqa_untied_yarn"]
    _, ours = _pair(args, seed=4)
    ours.eval()
    lengths = [11, 4, 9]
    docs = [torch.randint(0, args.vocab_size, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    segments = torch.cat([torch.full((1, n), i + 1) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        together = ours(packed, segment_ids=segments)
        alone = torch.cat([ours(d) for d in docs], dim=1)
    assert _rel(together, alone) <= 1e-5


def test_padding_is_left_out_of_aux_loss_like_transformers_attention_mask():
    args = CONFIGS["tied_mqa_default_rope_clamped"]
    hf, ours = _pair(args, seed=5)
    ids = torch.randint(0, args.vocab_size, (2, 10))
    segments = torch.ones(2, 10, dtype=torch.long)
    segments[1, 7:] = 0  # right padding
    attention_mask = (segments != 0).long()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=attention_mask)
        out = ours(ids, segment_ids=segments)
    real = attention_mask.bool()
    assert _rel(out[real], ref.logits[real]) <= 1e-4
    assert _rel(ours.aux_loss(), ref.aux_loss) <= 1e-5


def test_sliding_window_mask_is_transformers_band():
    mask = sliding_window_mask(causal_mask(9, "cpu"), 3)[0, 0]
    for i in range(9):
        for j in range(9):
            assert bool(mask[i, j]) == (i - 3 < j <= i)


def test_yarn_frequencies_and_scaling_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for args in (CONFIGS["sliding_full_gqa_untied_yarn"], CONFIGS["yarn_truncate_no_bias"]):
        config = transformers.GptOssConfig(**args.to_hf_dict())
        expected, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        ours, our_scale = yarn_from_parameters(
            args.attn_head_dim, args.rope, max_position_embeddings=args.max_position_embeddings
        )
        assert torch.equal(ours, expected)
        assert our_scale == scale


def test_hf_folder_round_trip_through_loader_and_transformers(tmp_path: Path):
    from meshforge.checkpoint.hf import load_hf_weights, save_hf
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict

    args = CONFIGS["sliding_full_gqa_untied_yarn"]
    reference = _hf_model(args, seed=6).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()

    model_cfg = config_from_dict({"model": {"model_name_or_path": str(src), "model_type": "gpt_oss"}}).model
    source = resolve_model_source(model_cfg)
    assert source.family.name == "gpt_oss"
    assert source.family.parse_options(source.options).to_hf_dict() == args.to_hf_dict()
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    load_hf_weights(model, source.family, src)
    model.eval()

    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        assert _rel(model(ids), expected) <= 1e-4
        out = tmp_path / "export"
        save_hf(model, source.family, out)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(reloaded).__name__ == "GptOssForCausalLM"
        assert _rel(reloaded(ids).logits, expected) <= 1e-4


def test_quantised_checkpoint_formats_mxfp4_read_others_refused_clearly():
    from meshforge.models.gpt_oss import hf as gpt_oss_hf

    # MXFP4 (the published release) is dequantised at load (tests/unit/test_dequant.py).
    assert gpt_oss_hf.from_hf_config(
        {"model_type": "gpt_oss", "hidden_size": 64, "quantization_config": {"quant_method": "mxfp4"}}
    ) == {"hidden_size": 64}
    with pytest.raises(ValueError, match="quant_method: not supported yet: 'awq' \\(handled: fp8 .*mxfp4"):
        gpt_oss_hf.from_hf_config({"model_type": "gpt_oss", "quantization_config": {"quant_method": "awq"}})


def test_args_mirror_transformers_defaults_and_validate():
    defaults = GptOssArgs().to_hf_dict()
    config = transformers.GptOssConfig()
    for key, value in defaults.items():
        assert getattr(config, key) == value, key
    # Older spellings from real config.json files.
    legacy = from_options(
        {
            "flavor": "debug",
            "num_experts": 8,
            "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
        }
    )
    assert legacy.num_local_experts == 8 and legacy.rope["rope_theta"] == 150000.0
    with pytest.raises(ValueError, match="not supported yet: rope_type dynamic"):
        from_options({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        from_options({"flavor": "debug", "layer_types": ["full_attention", "local"]})
    with pytest.raises(ValueError, match="layer_types: needs one entry per layer"):
        from_options({"flavor": "debug", "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="sliding_window: required"):
        from_options({"flavor": "debug", "sliding_window": None})
    with pytest.raises(ValueError, match="did you mean 'num_local_experts'"):
        from_options({"num_local_expert": 4})


def test_aux_loss_is_none_without_output_router_logits():
    args = replace(CONFIGS["yarn_truncate_no_bias"], output_router_logits=False)
    model = build_gpt_oss(args, device="cpu")
    model(torch.randint(0, args.vocab_size, (1, 8)))
    assert model.aux_loss() is None
    assert sorted(model.tokens_per_expert()) == [0, 1]


def test_init_is_deterministic_and_like_transformers():
    args = FLAVORS["debug"]
    a, b = build_gpt_oss(args, device="cpu"), build_gpt_oss(args, device="cpu")
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    params = dict(a.named_parameters())
    assert torch.all(params["model.layers.0.input_layernorm.weight"] == 1)
    assert torch.all(params["model.layers.0.mlp.experts.down_proj_bias"] == 0)
    assert torch.all(params["model.layers.0.self_attn.q_proj.bias"] == 0)
    for name in (
        "model.layers.0.self_attn.sinks",
        "model.layers.1.mlp.router.bias",
        "model.embed_tokens.weight",
    ):
        assert 0.005 < params[name].std().item() < 0.05, name
    with pytest.raises(ValueError, match="not a gpt-oss parameter"):
        a.init_full_parameter_("model.foo", torch.empty(2), torch.Generator())


def test_family_spec_builds_on_meta_and_counts_active_parameters():
    model = FAMILY.build({"flavor": "tiny"})
    assert next(model.parameters()).device.type == "meta"
    args = FLAVORS["tiny"]
    assert [layer.attention_type for layer in model.model.layers] == [
        "sliding_attention",
        "full_attention",
    ] * 2
    experts = 4 * sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters())
    total = model.num_params()
    assert model.num_params(active=True) == total - experts * 6 // 8
    assert model.flops_per_token(128) > 6 * (total - experts * 6 // 8 - args.vocab_size * args.hidden_size)


def _clone_pair(args: GptOssArgs):
    a = build_gpt_oss(args, device="cpu")
    b = build_gpt_oss(args, device="cpu")
    with torch.no_grad():
        for name, p in a.model.layers.named_parameters():
            if p.dim() == 3 or ".router." in name:
                p.normal_(0.0, 0.3)  # experts and routers: values that exercise routing and clamps
    b.load_state_dict(a.state_dict())
    return a, b


def test_kernel_switches_grouped_gemm_same_numbers_fix_router_balanced_flash_refused():
    from meshforge.models.common.kernels import KernelOptions, supports_hidden_output

    args = replace(CONFIGS["sliding_full_gqa_untied_yarn"], intermediate_size=8)
    plain, grouped = _clone_pair(args)
    grouped.configure_kernels(KernelOptions(grouped_mm=True, fused_rmsnorm=False))
    assert all(block.experts.use_grouped_mm for block in grouped.moe_layers().values())
    ids = torch.randint(0, args.vocab_size, (2, 13), generator=torch.Generator().manual_seed(7))
    outs = []
    for model in (plain, grouped):
        logits = model(ids)
        (logits.square().mean() + model.aux_loss()).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert _rel(outs[1][0], outs[0][0]) <= 1e-5
    for name, grad in outs[0][1].items():
        assert _rel(outs[1][1][name], grad) <= 1e-4, name

    # The chunked loss reads the final hidden states and applies lm_head itself.
    assert supports_hidden_output(plain)
    with torch.no_grad():
        hidden = plain(ids, return_hidden=True)
        assert torch.equal(plain.lm_head(hidden), plain(ids))

    plain.configure_kernels(KernelOptions(fix_router=True))
    with torch.no_grad():
        plain(torch.randint(0, args.vocab_size, (2, 12)))
    for counts in plain.tokens_per_expert().values():
        assert int(counts.max() - counts.min()) <= 1  # 48 slots over 6 experts: 8 each

    with pytest.raises(ValueError, match="kernels.use_flash_attn: gpt_oss attention has per-head sink"):
        plain.configure_kernels(KernelOptions(flash_attn=True, flash_attn_strict=True))
    plain.configure_kernels(KernelOptions(flash_attn=True))  # auto: keeps the explicit softmax


def test_bf16_rounds_like_transformers():
    args = CONFIGS["sliding_full_gqa_untied_yarn"]
    hf, ours = _pair(args)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(0, args.vocab_size, (2, 29), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_router_logits=True)
        out = ours(ids)
    # bf16 rounding level; the norm's scale-then-cast order matters here (GptOssRMSNorm).
    assert _rel(out.float(), ref.logits.float()) <= 2e-2
    for i, router_logits in enumerate(ref.router_logits):
        picks = torch.topk(router_logits, args.num_experts_per_tok, dim=-1).indices
        assert torch.equal(ours.tokens_per_expert()[i], torch.bincount(picks.flatten(), minlength=6))
    ours(ids).float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


def test_registry_resolves_gpt_oss_by_every_name():
    from meshforge.models.registry import check_model_options, resolve_family

    for names in (
        {"model_type": "gpt_oss"},
        {"architectures": ["GptOssForCausalLM"]},
        {"model_id": "gpt_oss"},
    ):
        assert resolve_family(**names) is FAMILY or resolve_family(**names).name == "gpt_oss"
    problems = check_model_options("gpt_oss", None, None, {"flavor": "tiny", "num_local_expert": 3})
    assert problems == [("num_local_expert", "not a gpt_oss model option; did you mean 'num_local_experts'?")]


def test_published_gpt_oss_20b_config_builds_with_its_parameter_counts():
    """openai/gpt-oss-20b's config.json (minus its MXFP4 quantization_config): 20.9B total, 3.6B active."""
    from meshforge.models.gpt_oss import hf as gpt_oss_hf

    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "vocab_size": 201088,
    }
    model = FAMILY.build(gpt_oss_hf.from_hf_config(config))
    assert round(model.num_params() / 1e9, 1) == 20.9
    assert round(model.num_params(active=True, exclude_embedding=True) / 1e9, 1) == 3.6
    assert model.args.rope["rope_theta"] == 150000.0 and model.args.rope["rope_type"] == "yarn"
