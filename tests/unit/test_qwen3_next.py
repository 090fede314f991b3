"""Built-in Qwen3-Next against transformers' Qwen3NextForCausalLM: logits, loss, aux loss, gradients;
the chunked gated delta rule against a token-by-token recurrence and transformers' torch path;
packed documents, position ids, chunk sizes, the HF folder round trip, args, init and kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.kernels import KernelOptions  # noqa: E402
from meshforge.models.qwen3_next import gdn  # noqa: E402
from meshforge.models.qwen3_next import hf as next_hf  # noqa: E402
from meshforge.models.qwen3_next.args import FLAVORS, OPTION_KEYS, Qwen3NextArgs, from_options  # noqa: E402
from meshforge.models.qwen3_next.model import Qwen3NextForCausalLM, build_qwen3_next  # noqa: E402
from meshforge.models.qwen3_next.spec import FAMILY  # noqa: E402
from tests.unit._parity import assert_grads_match, load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")
hf_modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    max_position_embeddings=128,
    rope_theta=10_000.0,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    # 4 layers alternating DeltaNet / attention, MoE everywhere but layer 2 (mlp_only_layers),
    # GQA in both mixers (2 k heads for 4 v heads, 4 q heads for 2 kv heads), untied, RoPE on 1/4.
    "hybrid_moe_untied": Qwen3NextArgs(
        **SMALL,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[2],
    ),
    # Tied; decoder_sparse_step 2 (layers 0, 2 dense); explicit layer_types; equal k/v heads of
    # different sizes; half the head rotated; raw top-k probabilities; conv width 3.
    "sparse_step2_tied": Qwen3NextArgs(
        **SMALL,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=3,
        num_experts=6,
        num_experts_per_tok=3,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    ),
    # Dense only (every layer in mlp_only_layers), tied. transformers' aux loss fails without
    # MoE layers, so output_router_logits is off.
    "dense_tied": Qwen3NextArgs(
        **{**SMALL, "output_router_logits": False},
        num_hidden_layers=2,
        full_attention_interval=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0, 1],
        tie_word_embeddings=True,
    ),
}


def _hf_model(args: Qwen3NextArgs, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**args.to_hf_dict())
    config._attn_implementation = "sdpa"
    hf = transformers.Qwen3NextForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                # Sharper routing than the 0.02 init, so top-k choices are clear-cut.
                p.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
    return hf


def _pair(args: Qwen3NextArgs, seed: int = 0):
    hf = _hf_model(args, seed)
    ours = Qwen3NextForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_aux_loss_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    kinds = [layer.layer_type for layer in ours.model.layers]
    assert kinds == [layer.block_type for layer in hf.model.layers] == args.resolved_layer_types
    assert {"linear_attention", "full_attention"} <= set(kinds) or name == "dense_tied"
    moe_layers = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    assert sorted(ours.moe_layers()) == moe_layers
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == args.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 37), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 37), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids)
    out = ours(ids)
    assert out.shape == ref.logits.shape == (2, 37, args.vocab_size)
    assert _rel(out, ref.logits) <= 1e-5
    ours_aux = ours.aux_loss()
    if moe_layers:
        assert _rel(ours_aux, ref.aux_loss) <= 1e-5
    else:
        assert ours_aux is None

    coef = args.router_aux_loss_coef
    losses = {}
    for key, logits, aux in (("hf", ref.logits, ref.aux_loss), ("ours", out, ours_aux)):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        if moe_layers:
            loss = loss + coef * aux
        loss.backward()
        losses[key] = loss.detach()
    assert _rel(losses["ours"], losses["hf"]) <= 1e-5
    assert_grads_match(hf, ours, tol=1e-4)


def _rule_inputs(seed: int, *, batch=2, seq=45, k_heads=2, v_heads=4, dk=8, dv=6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, k_heads, dk, generator=gen)
    k = torch.randn(batch, seq, k_heads, dk, generator=gen)
    v = torch.randn(batch, seq, v_heads, dv, generator=gen)
    g = -torch.rand(batch, seq, v_heads, generator=gen) * 2
    beta = torch.rand(batch, seq, v_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunked_rule_equals_the_recurrence_with_and_without_resets(chunk_size):
    inputs = [x.requires_grad_() for x in _rule_inputs(0)]
    segments = torch.tensor([[1] * 10 + [2] * 20 + [3] * 15, [0] * 3 + [1] * 42])
    for seg in (None, segments):
        chunked = gdn.chunk_gated_delta_rule(*inputs, chunk_size=chunk_size, segment_ids=seg)
        grads_c = torch.autograd.grad((chunked * chunked.detach().sin()).sum(), inputs)
        naive = gdn.recurrent_gated_delta_rule(*inputs, segment_ids=seg)
        grads_n = torch.autograd.grad((naive * naive.detach().sin()).sum(), inputs)
        assert _rel(chunked, naive) <= 1e-5
        for a, b in zip(grads_c, grads_n, strict=True):
            assert _rel(a, b) <= 1e-4


def test_rule_equals_transformers_torch_paths_and_resets_equal_separate_runs():
    q, k, v, g, beta = _rule_inputs(1)
    ours = gdn.chunk_gated_delta_rule(q, k, v, g, beta)
    chunked, _ = hf_modeling.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    recurrent, _ = hf_modeling.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
    )
    assert _rel(ours, chunked) <= 1e-6 and _rel(ours, recurrent) <= 1e-5
    # A reset is exactly a fresh start: each document alone gives the same outputs.
    seg = torch.tensor([[1] * 13 + [2] * 32, [5] * 40 + [6] * 5])
    packed = gdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, segment_ids=seg)
    for row, cut in ((0, 13), (1, 40)):
        for span in (slice(0, cut), slice(cut, 45)):
            parts = [x[row : row + 1, span] for x in (q, k, v, g, beta)]
            alone = gdn.chunk_gated_delta_rule(*parts, chunk_size=8)
            assert _rel(packed[row : row + 1, span], alone) <= 1e-6


def test_causal_conv_restarts_at_document_starts():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 5, 12, generator=gen)
    weight = torch.randn(5, 1, 4, generator=gen)
    assert torch.allclose(
        gdn.causal_conv1d(x, weight, torch.ones(1, 12, dtype=torch.long)),
        gdn.causal_conv1d(x, weight),
        atol=1e-6,
    )
    seg = torch.tensor([[1] * 2 + [2] * 7 + [3] * 3])
    packed = gdn.causal_conv1d(x, weight, seg)
    for span in (slice(0, 2), slice(2, 9), slice(9, 12)):
        assert torch.allclose(packed[..., span], gdn.causal_conv1d(x[..., span], weight), atol=1e-6)


def test_packed_documents_equal_separate_runs():
    args = CONFIGS["hybrid_moe_untied"]
    _, ours = _pair(args, seed=5)
    lengths = [7, 12, 5]
    docs = [torch.randint(0, args.vocab_size, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    segment_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, segment_ids=segment_ids)[0]
        whole = ours(packed)[0]
        start = 0
        for doc in docs:
            alone = ours(doc[None])[0]
            assert _rel(out[start : start + len(doc)], alone) <= 1e-5
            start += len(doc)
        # Without segment ids the later documents do see the earlier ones.
        assert _rel(whole[7:], out[7:]) > 1e-3


def test_padding_and_position_ids_like_transformers():
    args = CONFIGS["sparse_step2_tied"]
    hf, ours = _pair(args, seed=4)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    segment_ids = torch.tensor([[1] * 11 + [0] * 5, [1] * 16])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=(segment_ids != 0).long())
        out = ours(ids, segment_ids=segment_ids)
        real = segment_ids != 0
        assert _rel(out[real], ref.logits[real]) <= 1e-5
        assert _rel(ours.aux_loss(), ref.aux_loss) <= 1e-5
        # Explicit positions (stretched rows: RoPE ignores a constant offset) reach the attention.
        positions = torch.arange(16).expand(2, 16) * torch.tensor([[2], [3]]) + 5
        ref = hf(input_ids=ids, position_ids=positions).logits
        assert _rel(ours(ids, position_ids=positions), ref) <= 1e-5
        assert _rel(ours(ids), ref) > 1e-4


def test_gdn_chunk_size_switch_gives_the_same_numbers():
    args = CONFIGS["hybrid_moe_untied"]
    _, ours = _pair(args, seed=7)
    ids = torch.randint(0, args.vocab_size, (2, 40))
    results = []
    for chunk in (64, 8):
        ours.configure_kernels(KernelOptions(gdn_chunk_size=chunk))
        assert ours.model.layers[0].linear_attn.chunk_size == chunk
        ours.zero_grad()
        out = ours(ids)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}))
    (out64, grads64), (out8, grads8) = results
    assert _rel(out8, out64) <= 1e-5
    for n, g in grads64.items():
        # Looser for gradients: e.g. dt_bias's sums over all tokens cancel to ~1e-4 of their terms.
        assert _rel(grads8[n], g) <= 1e-3, n
    # Plain KernelOptions (no gdn fields) keeps the chunk size; the common switches still apply.
    ours.configure_kernels(KernelOptions(fused_rmsnorm=False))
    assert ours.model.layers[0].linear_attn.chunk_size == 8
    assert ours.model.norm.fused is False and ours.model.layers[0].linear_attn.norm.fused is False


def test_bad_chunk_size_is_refused_by_key():
    """(The Triton/Ascend Gated DeltaNet switches are refused by the config as not supported yet:
    tests/unit/test_config_unsupported.py.)"""
    model = build_qwen3_next(FLAVORS["debug"], device="meta")
    with pytest.raises(ValueError, match="kernels.gdn_chunk_size"):
        model.configure_kernels(KernelOptions(gdn_chunk_size=0))
    with pytest.raises(ValueError, match="gdn_chunk_size"):
        gdn.chunk_gated_delta_rule(*_rule_inputs(0), chunk_size=0)


def test_fused_and_reference_norms_agree():
    args = CONFIGS["hybrid_moe_untied"]
    _, ours = _pair(args, seed=8)
    ids = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        fused = ours(ids)
        ours.configure_kernels(KernelOptions(fused_rmsnorm=False))
        assert _rel(ours(ids), fused) <= 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_round_trip(tmp_path, tied):
    from safetensors.torch import load_file, save_file

    from meshforge.checkpoint.hf import load_hf_weights, save_hf
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict

    args = replace(CONFIGS["hybrid_moe_untied"], tie_word_embeddings=tied)
    reference = _hf_model(args, seed=6).eval()
    src = tmp_path / "src"
    reference.save_pretrained(src)
    saved = load_file(src / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved  # per-expert keys on disk
    # Published checkpoints carry multi-token-prediction weights; like transformers, they are skipped.
    save_file(
        {**saved, "mtp.fc.weight": torch.zeros(2, 2)}, src / "model.safetensors", metadata={"format": "pt"}
    )

    # The folder alone names the family and its options (config.json through the adapter).
    source = resolve_model_source(config_from_dict({"model": {"model_name_or_path": str(src)}}).model)
    assert source.family.name == "qwen3_next"
    assert FAMILY.parse_options(source.options).to_hf_dict() == args.to_hf_dict()
    model = source.family.build(source.options)
    model.to_empty(device="cpu")
    load_hf_weights(model, source.family, src)
    model.eval()
    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        assert _rel(model(ids), expected) <= 1e-5
        out = tmp_path / "export"
        save_hf(model, FAMILY, out, shard_size="20KB")
        written = {}
        for shard in out.glob("*.safetensors"):
            written.update(load_file(shard))
        assert set(written) == set(saved) - ({"lm_head.weight"} if tied else set())
        for key, tensor in written.items():
            assert torch.equal(tensor, saved[key]), key
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(reloaded).__name__ == "Qwen3NextForCausalLM"
        assert _rel(reloaded(ids).logits, expected) <= 1e-5


def test_config_json_of_transformers_maps_onto_args(tmp_path):
    import json

    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict

    for name in ("sparse_step2_tied", "hybrid_moe_untied"):
        args = CONFIGS[name]
        transformers.Qwen3NextConfig(**args.to_hf_dict()).save_pretrained(tmp_path / name)
        on_disk = json.loads((tmp_path / name / "config.json").read_text())
        assert len(on_disk["layer_types"]) == args.num_hidden_layers  # written out per layer
        parsed = from_options(next_hf.from_hf_config(on_disk))
        assert parsed.to_hf_dict() == args.to_hf_dict()
    assert next_hf.to_hf_config(args)["architectures"] == ["Qwen3NextForCausalLM"]
    # A per-layer list that follows the interval rule comes back as the interval, so a smaller
    # model: num_hidden_layers keeps the pattern; an irregular list is kept as it is.
    assert next_hf.from_hf_config(on_disk)["full_attention_interval"] == 2
    irregular = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    assert next_hf.from_hf_config({**on_disk, "layer_types": irregular})["layer_types"] == irregular
    section = {"model_name_or_path": str(tmp_path / "hybrid_moe_untied"), "num_hidden_layers": 6}
    source = resolve_model_source(config_from_dict({"model": section}).model)
    assert (
        FAMILY.parse_options(source.options).resolved_layer_types
        == ["linear_attention", "full_attention"] * 3
    )


def test_published_qwen3_next_80b_a3b_config_gives_its_parameter_counts():
    # config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (written by transformers 4.57).
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    options = next_hf_options(config)
    args = FAMILY.parse_options(options)
    assert args.resolved_layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert args.rotary_dim == 64 and args.theta == 1e7
    model = FAMILY.build(options)
    hidden, vocab, experts, expert_width, shared = 2048, 151936, 512, 512, 512
    moe = experts * hidden + experts * 3 * expert_width * hidden + 3 * shared * hidden + hidden
    active_moe = moe - (experts - 10) * 3 * expert_width * hidden
    key_dim, value_dim = 16 * 128, 32 * 128
    deltanet = (
        hidden * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
        + hidden * 2 * 32  # in_proj_ba
        + (2 * key_dim + value_dim) * 4  # depthwise conv
        + 2 * 32  # dt_bias, A_log
        + 128  # gated norm
        + value_dim * hidden  # out_proj
    )
    attention = hidden * 16 * 256 * 2 + 2 * hidden * 2 * 256 + 16 * 256 * hidden + 2 * 256
    dense_part = 36 * deltanet + 12 * attention + 48 * 2 * hidden + 2 * vocab * hidden + hidden
    assert model.num_params() == dense_part + 48 * moe
    assert model.num_params(active=True) == dense_part + 48 * active_moe
    # Published: 80B parameters in total, 79B without embeddings, 3B activated.
    assert round(model.num_params() / 1e9) == 80
    assert round((model.num_params() - 2 * vocab * hidden) / 1e9) == 79
    assert 3.0e9 <= model.num_params(active=True) - 2 * vocab * hidden < 3.5e9


def next_hf_options(config: dict) -> dict:
    """The ``model:`` options the HF loader keeps from a config.json (its option-key filter)."""
    return {k: v for k, v in config.items() if k in OPTION_KEYS}


def test_args_validation_names_keys():
    with pytest.raises(ValueError, match=r"mlp_only_layers\[1\]"):
        from_options({"flavor": "debug", "mlp_only_layers": [0, 5]})
    with pytest.raises(ValueError, match=r"layer_types\[1\]"):
        from_options({"flavor": "debug", "layer_types": ["full_attention", "mamba"]})
    with pytest.raises(ValueError, match="layer_types: needs one entry per layer"):
        from_options({"flavor": "debug", "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        from_options({"flavor": "debug", "linear_num_key_heads": 3})
    with pytest.raises(ValueError, match=r"partial_rotary_factor: must be in \(0, 1\]"):
        from_options({"flavor": "debug", "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="partial_rotary_factor: head_dim"):
        from_options({"flavor": "debug", "partial_rotary_factor": 0.1})  # 1.6 -> 1 rotated dimension
    with pytest.raises(ValueError, match="use_sliding_window"):
        from_options({"use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_scaling"):
        from_options({"rope_scaling": {"type": "yarn"}})
    with pytest.raises(ValueError, match="did you mean 'num_experts'"):
        from_options({"num_expert": 4})
    assert from_options({"flavor": "tiny", "router_aux_loss_coef": "1e-3"}).router_aux_loss_coef == 1e-3
    # A new layer count re-derives the kinds from full_attention_interval.
    deeper = from_options({"flavor": "debug", "num_hidden_layers": 4})
    assert deeper.resolved_layer_types == ["linear_attention", "full_attention"] * 2


@pytest.mark.procs
def test_spec_and_args_import_no_torch():
    code = (
        "import sys; from meshforge.models.qwen3_next.spec import FAMILY; "
        "FAMILY.parse_options({'flavor': 'tiny'}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert FAMILY.name == "qwen3_next" and FAMILY.model_ids == ("qwen3_next",)
    from meshforge.models.registry import built_families, resolve_family

    assert "qwen3_next" in built_families()
    for named in (
        {"model_type": "qwen3_next"},
        {"architectures": ["Qwen3NextForCausalLM"]},
        {"model_id": "qwen3_next"},
    ):
        assert resolve_family(**named).name == "qwen3_next"


def test_init_meta_build_and_bfloat16_training():
    args = from_options({"flavor": "debug", "pad_token_id": 3, "tie_word_embeddings": False})
    meta = build_qwen3_next(args, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    model = build_qwen3_next(args, device="cpu")
    again = build_qwen3_next(args, device="cpu")
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):
            assert torch.all(p == 1), name
        elif name.endswith("norm.weight"):
            assert torch.all(p == 0), name  # zero-centred: scale 1 + weight
        elif name.endswith("A_log"):
            assert p.exp().min() >= 0.01 - 1e-6 and p.exp().max() <= 16 + 1e-4
        elif name == "model.embed_tokens.weight":
            assert torch.all(p[3] == 0)
        else:
            assert abs(p.std().item() - args.initializer_range) < 0.3 * args.initializer_range, name
    # Active parameters: each MoE layer uses top_k of its experts.
    block = model.moe_layers()[1]
    expert_params = block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
    inactive = expert_params * (args.num_experts - args.num_experts_per_tok) // args.num_experts
    assert model.num_params(active=True) == model.num_params() - inactive
    # FLOPs: every active weight but the embedding, norms, conv and decay parameters is a matmul.
    not_matmul = args.vocab_size * args.hidden_size + sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith(("norm.weight", "conv1d.weight", "dt_bias", "A_log"))
    )
    attention = 12 * 1 * args.num_attention_heads * args.head_dim * 32
    deltanet = 6 * 4 * (3 * 16 * 16 + 64 * (2 * 16 + 16))
    expected = 6.0 * (model.num_params(active=True) - not_matmul) + attention + deltanet
    assert model.flops_per_token(32) == expected

    model = model.to(torch.bfloat16)
    ids = torch.randint(0, args.vocab_size, (2, 12))
    logits = model(ids, segment_ids=torch.tensor([[1] * 12, [1] * 7 + [0] * 5]))
    aux = model.aux_loss()
    assert logits.dtype == torch.bfloat16 and aux.dtype == torch.float32
    (logits.float().logsumexp(-1).mean() + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tiny_config_model_section_builds():
    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_next", "tiny.yaml")
    with open(path) as f:
        section = yaml.safe_load(f)["model"]
    assert section["model_type"] == FAMILY.name
    options = {k: v for k, v in section.items() if k in OPTION_KEYS}
    args = FAMILY.parse_options(options)
    assert args == FLAVORS["tiny"]
    model = FAMILY.build(options)
    assert [layer.layer_type for layer in model.model.layers].count("full_attention") == 1
