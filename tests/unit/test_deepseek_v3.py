"""Built-in DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: logits, loss, gradients,
routing (correction bias, groups, scaling), packing, the safetensors adapter and HF folders, args."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.mla import apply_rotary_interleaved  # noqa: E402
from meshforge.models.deepseek_v3 import hf as ds_hf  # noqa: E402
from meshforge.models.deepseek_v3.args import FLAVORS, DeepseekV3Args, from_options  # noqa: E402
from meshforge.models.deepseek_v3.model import DeepseekV3ForCausalLM, build_deepseek_v3  # noqa: E402
from meshforge.models.deepseek_v3.spec import FAMILY  # noqa: E402
from tests.unit._parity import load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    max_position_embeddings=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_nextn_predict_layers=0,
)
CONFIGS = {
    # q LoRA, one dense layer first, 8 experts in 4 groups (best 2 kept), 2 shared experts,
    # scaled weights, untied head, interleaved rope.
    "qlora_groups_untied": DeepseekV3Args(
        **SMALL,
        num_hidden_layers=3,
        q_lora_rank=24,
        n_routed_experts=8,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
    ),
    # Plain q_proj, every layer sparse, one group, raw (unnormalised) scores, tied head,
    # rotate-half rope, attention biases.
    "plain_q_tied_halfrope": DeepseekV3Args(
        **SMALL,
        num_hidden_layers=2,
        q_lora_rank=None,
        n_routed_experts=6,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        tie_word_embeddings=True,
        rope_interleave=False,
        attention_bias=True,
        rope_theta=50_000.0,
    ),
    # Two dense layers then sparse; 3 groups of 4, one group kept; tied; q LoRA.
    "dense2_onegroup_tied": DeepseekV3Args(
        **SMALL,
        num_hidden_layers=3,
        q_lora_rank=12,
        n_routed_experts=12,
        n_shared_experts=1,
        n_group=3,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        routed_scaling_factor=1.0,
        tie_word_embeddings=True,
    ),
}


def _hf_model(args: DeepseekV3Args, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**args.to_hf_dict())
    config._attn_implementation = "sdpa"
    hf = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                # Sharper routing than the 0.02 init, so top-k choices are clear-cut.
                p.normal_(0.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A non-zero correction bias, large enough to change which experts are chosen.
                b.normal_(0.0, 0.2)
    return hf


def _pair(args: DeepseekV3Args, seed: int = 0):
    hf = _hf_model(args, seed)
    ours = DeepseekV3ForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    moe_layers = [i for i in range(args.num_hidden_layers) if i >= args.first_k_dense_replace]
    assert sorted(ours.moe_layers()) == moe_layers
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == moe_layers
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == args.tie_word_embeddings
    assert hasattr(ours.model.layers[0].self_attn, "q_proj") == (args.q_lora_rank is None)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 29), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids)
    out = ours(ids)
    assert out.shape == ref.logits.shape == (2, 29, args.vocab_size)
    assert _rel(out, ref.logits) <= 1e-4
    assert ours.aux_loss() is None and getattr(ref, "aux_loss", None) is None

    losses = {}
    for key, logits in (("hf", ref.logits), ("ours", out)):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
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
    assert frozen == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in moe_layers]


def test_routing_follows_correction_bias_groups_and_scaling():
    args = CONFIGS["qlora_groups_untied"]
    hf, ours = _pair(args, seed=2)
    ids = torch.randint(0, args.vocab_size, (3, 17))
    block = ours.model.layers[1].mlp
    x = torch.randn(40, args.hidden_size)
    with torch.no_grad():
        _, weights, indices = block.gate(x)
        _, ref_weights, ref_indices = hf.model.layers[1].mlp.gate(x)
        order, ref_order = indices.sort(-1), ref_indices.sort(-1)
        assert torch.equal(order.values, ref_order.values)
        assert _rel(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)) <= 1e-6
        # Normalised then scaled: every token's weights sum to routed_scaling_factor.
        assert torch.allclose(weights.sum(-1), torch.full((40,), args.routed_scaling_factor))
        # Group limit: all chosen experts lie in at most topk_group of the n_group groups.
        groups = indices // (args.n_routed_experts // args.n_group)
        assert all(len(set(row.tolist())) <= args.topk_group for row in groups)
        # The bias changes the choice (selection only) ...
        saved = block.gate.e_score_correction_bias.clone()
        block.gate.e_score_correction_bias.zero_()
        _, unbiased_weights, unbiased = block.gate(x)
        assert not torch.equal(unbiased.sort(-1).values, order.values)
        block.gate.e_score_correction_bias.copy_(saved)

        ours(ids)
    counts = ours.tokens_per_expert()
    assert sorted(counts) == [1, 2]
    for c in counts.values():
        assert c.dtype == torch.long and c.shape == (args.n_routed_experts,)
        assert int(c.sum()) == 3 * 17 * args.num_experts_per_tok


def test_packed_documents_equal_separate_runs():
    args = CONFIGS["qlora_groups_untied"]
    _, ours = _pair(args, seed=5)
    lengths = [7, 12, 5]
    docs = [torch.randint(0, args.vocab_size, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    segment_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, segment_ids=segment_ids)[0]
        packed_counts = ours.tokens_per_expert()
        summed = {i: torch.zeros_like(c) for i, c in packed_counts.items()}
        start = 0
        for doc in docs:
            alone = ours(doc[None])[0]
            assert _rel(out[start : start + len(doc)], alone) <= 1e-5
            for i, c in ours.tokens_per_expert().items():
                summed[i] += c
            start += len(doc)
    for i in packed_counts:
        assert torch.equal(packed_counts[i], summed[i])


def test_padding_positions_match_transformers_attention_mask():
    args = CONFIGS["plain_q_tied_halfrope"]
    hf, ours = _pair(args, seed=4)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    segment_ids = torch.tensor([[1] * 11 + [0] * 5, [1] * 16])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=(segment_ids != 0).long()).logits
        out = ours(ids, segment_ids=segment_ids)
    real = segment_ids != 0
    assert _rel(out[real], ref[real]) <= 1e-4


def test_interleaved_rotation_is_the_pairwise_rotation():
    x = torch.randn(1, 3, 2, 6)
    angles = torch.rand(1, 3, 3)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    out = apply_rotary_interleaved(x, cos, sin)
    for i in range(3):
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        c, s = cos[..., i].unsqueeze(-1), sin[..., i].unsqueeze(-1)
        assert torch.allclose(out[..., i], a * c - b * s)
        assert torch.allclose(out[..., 3 + i], b * c + a * s)


def test_bfloat16_parameters_train():
    model = build_deepseek_v3(FLAVORS["debug"], device="cpu").to(torch.bfloat16)
    ids = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 12))
    logits = model(ids, segment_ids=torch.tensor([[1] * 12, [1] * 7 + [0] * 5]))
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
    )


@pytest.mark.parametrize("tied", [False, True])
def test_hf_adapter_round_trip_against_save_pretrained(tmp_path, tied):
    from safetensors.torch import load_file

    args = replace(CONFIGS["qlora_groups_untied"], tie_word_embeddings=tied)
    hf = _hf_model(args, seed=6)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    memory = hf.state_dict()
    ours = DeepseekV3ForCausalLM(args)
    adapter = ds_hf.adapter(args)
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

    args = replace(CONFIGS["qlora_groups_untied"], tie_word_embeddings=tied)
    reference = _hf_model(args, seed=8).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src, max_shard_size="100KB")

    options = family_adapter(FAMILY).from_hf_config(read_hf_config(src))
    model = FAMILY.build(options, device="meta")
    assert model.args == replace(
        args, head_dim=8, qk_head_dim=16, rope_parameters={"rope_theta": 10_000.0, "rope_type": "default"}
    )
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
        assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
        assert _rel(reloaded(ids).logits, expected) <= 1e-4


def test_config_json_of_transformers_maps_onto_args(tmp_path):
    args = CONFIGS["plain_q_tied_halfrope"]
    config = transformers.DeepseekV3Config(**args.to_hf_dict())
    config.save_pretrained(tmp_path)
    from meshforge.checkpoint.hf import hf_adapter, read_hf_config

    options = hf_adapter(FAMILY).from_hf_config(read_hf_config(tmp_path))
    parsed = from_options(options)
    assert replace(parsed, head_dim=None, qk_head_dim=None, rope_theta=args.rope_theta) == replace(
        args, rope_parameters={"rope_type": "default", "rope_theta": 50_000.0}
    )
    assert parsed.theta == 50_000.0


def test_args_accept_mindformers_names_and_refuse_bad_values():
    args = from_options(
        {"flavor": "tiny", "n_routed_experts": 16, "num_experts_per_tok": 4, "num_local_experts": 16}
    )
    assert args.n_routed_experts == 16 and args.num_experts_per_tok == 4
    assert from_options({"flavor": "debug", "num_mtp_layers": 1}).num_nextn_predict_layers == 1
    assert from_options({"flavor": "debug", "q_lora_rank": None}).q_lora_rank is None
    bad = {
        "n_routed_experts_x": "did you mean 'n_routed_experts'",
        "n_group": "n_group: must divide",
        "topk_group": "topk_group: must be at most",
        "head_dim": "head_dim: DeepSeek-V3 ties it to qk_rope_head_dim",
        "num_key_value_heads": "num_key_value_heads: must equal num_attention_heads",
        "rope_parameters": "not supported yet",
    }
    values = {
        "n_routed_experts_x": 4,
        "n_group": 3,
        "topk_group": 3,
        "head_dim": 16,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0},
    }
    for key, message in bad.items():
        with pytest.raises(ValueError, match=message):
            from_options({"flavor": "debug", key: values[key]})
    with pytest.raises(ValueError, match="num_local_experts: is another name for n_routed_experts"):
        from_options({"n_routed_experts": 8, "num_local_experts": 16})


def test_init_meta_build_and_counts():
    model = build_deepseek_v3(FLAVORS["debug"], device="meta")
    assert all(p.is_meta for p in model.parameters())
    real = build_deepseek_v3(FLAVORS["debug"], device="cpu")
    gate = real.model.layers[1].mlp.gate
    assert torch.equal(gate.e_score_correction_bias, torch.zeros(4))
    assert real.model.layers[0].self_attn.kv_a_layernorm.weight.eq(1).all()
    assert 0.015 < float(real.model.layers[1].mlp.experts.gate_up_proj.detach().std()) < 0.025
    with pytest.raises(ValueError, match="not a DeepSeek-V3 parameter"):
        real.init_full_parameter_("model.foo", torch.empty(1), torch.Generator())
    assert real.num_params(active=True) < real.num_params()
    assert real.flops_per_token(64) > 6 * real.num_params(exclude_embedding=True, active=True) * 0.5


@pytest.mark.procs
def test_spec_and_args_import_no_torch():
    code = (
        "import sys; import meshforge.models.deepseek_v3.spec, meshforge.models.deepseek_v3.args; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_resolves_the_family_and_a_hf_folder(tmp_path):
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict
    from meshforge.models.registry import check_model_options, resolve_family

    assert resolve_family(model_type="deepseek_v3") is resolve_family(architectures=["DeepseekV3ForCausalLM"])
    assert (
        check_model_options("deepseek_v3", None, None, {"n_routed_experts": 8, "num_experts_per_tok": 2})
        == []
    )
    assert check_model_options("deepseek_v3", None, None, {"n_routed_expert": 8})[0][0] == "n_routed_expert"
    _hf_model(CONFIGS["dense2_onegroup_tied"], seed=9).save_pretrained(tmp_path)
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(tmp_path)}}).model
    source = resolve_model_source(model_cfg)
    assert source.family.name == "deepseek_v3"
    assert source.family.parse_options(source.options).n_routed_experts == 12


def test_tiny_config_model_section_builds():
    import yaml

    from meshforge.models.deepseek_v3.args import OPTION_KEYS

    path = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3" / "tiny.yaml"
    section = yaml.safe_load(path.read_text())["model"]
    assert section["model_type"] == FAMILY.name
    options = {k: v for k, v in section.items() if k in OPTION_KEYS}
    assert FAMILY.parse_options(options) == FLAVORS["tiny"]
    model = build_deepseek_v3(FLAVORS["tiny"], device="cpu")
    logits = model(torch.randint(0, 8192, (1, 6)))
    assert torch.isfinite(logits).all() and sorted(model.tokens_per_expert()) == [1, 2, 3]


# config.json of deepseek-ai/DeepSeek-V3 as published (DeepSeek's own modelling code, transformers 4.33 era).
PUBLISHED = json.loads((Path(__file__).parents[1] / "data" / "deepseek_v3_config.json").read_text())


def test_published_config_builds_with_yarn_and_counts_671b_37b():
    with pytest.raises(ValueError, match="scoring_func: not supported yet"):
        ds_hf.from_hf_config({**PUBLISHED, "scoring_func": "softmax"})
    args = from_options(ds_hf.from_hf_config(PUBLISHED))
    assert args.rope_type == "yarn" and args.rope_parameters["factor"] == 40
    assert args.num_nextn_predict_layers == 1
    model = build_deepseek_v3(replace(args, num_nextn_predict_layers=0))
    # DeepSeek-V3 report: 671B total, 37B activated per token (without the MTP module); the
    # exact counts here are 671.03B and 37.55B (embedding and head included).
    assert round(model.num_params() / 1e9) == 671
    assert 37.0 <= model.num_params(active=True) / 1e9 < 38.0


def test_kernel_switches_give_the_same_numbers():
    from meshforge.models.common.kernels import KernelOptions, configure_model_kernels, supports_hidden_output

    args = CONFIGS["qlora_groups_untied"]
    _, ours = _pair(args, seed=7)
    assert supports_hidden_output(ours)
    ids = torch.randint(0, args.vocab_size, (2, 13))
    weight = torch.linspace(-1, 1, args.vocab_size)
    results = {}
    # Plain; grouped GEMM experts; reference RMSNorm; the flash SDPA backend (on CPU too:
    # exercises the value padding to the query/key head size).
    for name, options in {
        "plain": KernelOptions(),
        "grouped_mm": KernelOptions(grouped_mm=True),
        "reference_norm": KernelOptions(fused_rmsnorm=False),
        "flash": KernelOptions(flash_attn=True),
    }.items():
        configure_model_kernels(ours, options, family="deepseek_v3")
        ours.zero_grad()
        out = ours(ids)
        (out * weight).sum().backward()
        results[name] = (
            out.detach(),
            {n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad},
        )
    plain_out, plain_grads = results.pop("plain")
    for name, (out, grads) in results.items():
        assert _rel(out, plain_out) <= 1e-5, name
        for n, g in plain_grads.items():
            assert _rel(grads[n], g) <= 1e-4, (name, n)
    configure_model_kernels(ours, KernelOptions(), family="deepseek_v3")
    with torch.no_grad():
        hidden = ours(ids, return_hidden=True)
        assert torch.equal(ours.lm_head(hidden), ours(ids))


def test_fix_router_balances_and_keeps_scaled_weights():
    from meshforge.models.common.kernels import KernelOptions, configure_model_kernels

    args = CONFIGS["qlora_groups_untied"]
    _, ours = _pair(args, seed=8)
    configure_model_kernels(ours, KernelOptions(fix_router=True), family="deepseek_v3")
    with torch.no_grad():
        ours(torch.randint(0, args.vocab_size, (2, 16)))
        _, weights, _ = ours.model.layers[1].mlp.gate(torch.randn(5, args.hidden_size))
    for counts in ours.tokens_per_expert().values():
        assert counts.tolist() == [12] * 8  # 32 tokens * top-3 / 8 experts
    assert torch.allclose(weights.sum(-1), torch.full((5,), args.routed_scaling_factor))
    dense = DeepseekV3ForCausalLM(replace(CONFIGS["dense2_onegroup_tied"], first_k_dense_replace=3))
    with pytest.raises(ValueError, match="kernels.fix_router"):
        configure_model_kernels(dense, KernelOptions(fix_router=True), family="deepseek_v3")


def test_mindformers_skeleton_model_section():
    # The model: section of the MindFormers reference train.yaml (DeepSeek-V3 as its example).
    skeleton = {
        "vocab_size": 129280,
        "hidden_size": 1792,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 4,
    }
    from meshforge.models.registry import check_model_options

    assert check_model_options("deepseek_v3", "DeepseekV3ForCausalLM", None, skeleton) == []
    # transformers' default n_group 8 leaves one expert per group, which its router cannot score.
    with pytest.raises(ValueError, match="n_group: each group needs at least 2 experts.*n_group: 1"):
        from_options(skeleton)
    args = from_options({**skeleton, "n_group": 1, "topk_group": 1})
    assert args.num_key_value_heads == 8 and args.n_routed_experts == 8 and args.num_experts_per_tok == 4
    model = build_deepseek_v3(args)
    assert sorted(model.moe_layers()) == list(range(3, 12))  # no MTP block unless asked for
