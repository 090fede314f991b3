"""Built-in Qwen3-MoE against transformers' Qwen3MoeForCausalLM: logits, loss, aux loss, gradients,
routing counts, packing, the safetensors adapter, args and init."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.moe import GroupedExperts  # noqa: E402
from meshforge.models.qwen3_moe import hf as moe_hf  # noqa: E402
from meshforge.models.qwen3_moe.args import FLAVORS, OPTION_KEYS, Qwen3MoeArgs, from_options  # noqa: E402
from meshforge.models.qwen3_moe.model import Qwen3MoeForCausalLM, build_qwen3_moe  # noqa: E402
from meshforge.models.qwen3_moe.spec import FAMILY  # noqa: E402
from tests.unit._parity import assert_grads_match, load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    max_position_embeddings=128,
    rope_theta=10_000.0,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)
CONFIGS = {
    # Every layer sparse, GQA, untied head, renormalised top-k, head_dim from hidden/heads.
    "all_moe_untied_norm": Qwen3MoeArgs(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; tied; raw top-k probabilities.
    "sparse_step2_tied": Qwen3MoeArgs(
        **SMALL,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    ),
    # mlp_only_layers: layer 1 dense among sparse ones; top-3 of 8, MQA, tied, renormalised.
    "mlp_only_tied_norm": Qwen3MoeArgs(
        **SMALL,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
}


def _hf_model(args: Qwen3MoeArgs, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**args.to_hf_dict())
    config._attn_implementation = "sdpa"
    hf = transformers.Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                # Sharper routing than the 0.02 init, so top-k choices are clear-cut.
                p.normal_(0.0, 0.3)
    return hf


def _pair(args: Qwen3MoeArgs, seed: int = 0):
    hf = _hf_model(args, seed)
    ours = Qwen3MoeForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_aux_loss_and_grads_match_transformers(name):
    args = CONFIGS[name]
    hf, ours = _pair(args)
    moe_layers = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    assert sorted(ours.moe_layers()) == moe_layers
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == moe_layers
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


def test_tokens_per_expert_counts_every_assignment():
    args = CONFIGS["mlp_only_tied_norm"]
    hf, ours = _pair(args, seed=2)
    ids = torch.randint(0, args.vocab_size, (3, 17))
    with torch.no_grad():
        ours(ids)
        router_logits = hf(input_ids=ids).router_logits  # one [tokens, E] tensor per MoE layer
    counts = ours.tokens_per_expert()
    assert sorted(counts) == [0, 2] and len(router_logits) == 2
    for (layer, c), logits in zip(sorted(counts.items()), router_logits, strict=True):
        assert c.dtype == torch.long and c.shape == (args.num_experts,)
        assert int(c.sum()) == 3 * 17 * args.num_experts_per_tok
        # The same experts transformers' router picks for this layer.
        picked = logits.float().softmax(-1).topk(args.num_experts_per_tok, dim=-1).indices
        assert torch.equal(c, torch.bincount(picked.flatten(), minlength=args.num_experts)), layer
    with torch.no_grad():
        ours(ids[:1, :5])
    assert all(int(c.sum()) == 5 * args.num_experts_per_tok for c in ours.tokens_per_expert().values())


def test_bfloat16_parameters_train():
    model = build_qwen3_moe(FLAVORS["debug"], device="cpu").to(torch.bfloat16)
    ids = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 12))
    logits = model(ids, segment_ids=torch.tensor([[1] * 12, [1] * 7 + [0] * 5]))
    aux = model.aux_loss()
    assert logits.dtype == torch.bfloat16 and aux.dtype == torch.float32
    (logits.float().logsumexp(-1).mean() + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_aux_loss_follows_output_router_logits():
    args = replace(CONFIGS["all_moe_untied_norm"], output_router_logits=False)
    hf, ours = _pair(args, seed=3)
    ids = torch.randint(0, args.vocab_size, (1, 8))
    with torch.no_grad():
        assert hf(input_ids=ids).aux_loss is None
        ours(ids)
    assert ours.aux_loss() is None
    assert len(ours.tokens_per_expert()) == args.num_hidden_layers  # counts are always kept
    dense = Qwen3MoeForCausalLM(replace(args, output_router_logits=True, mlp_only_layers=[0, 1]))
    assert dense.moe_layers() == {} and dense.aux_loss() is None


def test_padding_is_left_out_of_aux_loss_like_transformers_attention_mask():
    args = CONFIGS["all_moe_untied_norm"]
    hf, ours = _pair(args, seed=4)
    ids = torch.randint(0, args.vocab_size, (2, 16))
    segment_ids = torch.tensor([[1] * 11 + [0] * 5, [1] * 16])
    with torch.no_grad():
        unmasked = (ours(ids), ours.aux_loss())[1]
        ref = hf(input_ids=ids, attention_mask=(segment_ids != 0).long())
        out = ours(ids, segment_ids=segment_ids)
    real = segment_ids != 0
    assert _rel(out[real], ref.logits[real]) <= 1e-4
    assert _rel(ours.aux_loss(), ref.aux_loss) <= 1e-5
    assert abs(float(unmasked) - float(ref.aux_loss)) > 1e-6  # padding really changes it
    # Counts for the monitor include padding tokens: every routed token is computed.
    assert all(int(c.sum()) == 32 * args.num_experts_per_tok for c in ours.tokens_per_expert().values())


def test_packed_documents_equal_separate_runs():
    args = CONFIGS["sparse_step2_tied"]
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


def test_grouped_experts_match_a_per_token_reference():
    torch.manual_seed(0)
    experts = GroupedExperts(5, 8, 6)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(11, 8)
    indices = torch.stack([torch.randperm(5)[:2] for _ in range(11)])
    indices[:, 0] = 3  # expert 3 busy, some experts idle or nearly so
    weights = torch.rand(11, 2)
    out = experts(x, indices, weights, torch.bincount(indices.flatten(), minlength=5))
    expected = torch.zeros(11, 8)
    for t in range(11):
        for j in range(2):
            e = int(indices[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
    assert _rel(out.detach(), expected.detach()) <= 1e-5
    empty = experts(x[:0], indices[:0], weights[:0], torch.zeros(5, dtype=torch.long))
    assert empty.shape == (0, 8)


def test_grouped_mm_switch_gives_the_same_numbers():
    args = CONFIGS["all_moe_untied_norm"]
    _, ours = _pair(args, seed=7)
    ids = torch.randint(0, args.vocab_size, (2, 13))
    results = []
    for flag in (False, True):
        for block in ours.moe_layers().values():
            block.experts.use_grouped_mm = flag
        ours.zero_grad()
        out = ours(ids)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}))
    (loop_out, loop_grads), (gmm_out, gmm_grads) = results
    assert _rel(gmm_out, loop_out) <= 1e-5
    for n, g in loop_grads.items():
        assert _rel(gmm_grads[n], g) <= 1e-5, n


@pytest.mark.parametrize("tied", [False, True])
def test_hf_adapter_round_trip_against_save_pretrained(tmp_path, tied):
    from safetensors.torch import load_file

    args = replace(CONFIGS["mlp_only_tied_norm"], tie_word_embeddings=tied)
    hf = _hf_model(args, seed=6)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    memory = hf.state_dict()
    ours = Qwen3MoeForCausalLM(args)
    adapter = moe_hf.adapter(args)

    # Load: every parameter from its safetensors sources equals transformers' in-memory tensor.
    for name, _ in ours.named_parameters():
        keys = adapter.hf_sources(name)
        assert keys == moe_hf.hf_sources(name, args.num_experts)
        tensor = adapter.from_hf(name, {k: saved[k] for k in keys})
        assert torch.equal(tensor, memory[name]), name
    assert any(len(adapter.hf_sources(n)) == 2 * args.num_experts for n, _ in ours.named_parameters())

    # Save: our in-memory tensors give back exactly the saved keys and tensors.
    ours.load_state_dict(memory)
    written = {}
    for name, param in ours.named_parameters():
        for key, tensor in moe_hf.to_hf(name, param.detach()).items():
            assert key not in written, key
            assert tensor.is_contiguous()
            written[key] = tensor
    expected_keys = set(saved) - ({"lm_head.weight"} if tied else set())
    assert set(written) == expected_keys
    for key, tensor in written.items():
        assert torch.equal(tensor, saved[key]), key

    config = moe_hf.to_hf_config(args)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"


def test_hf_adapter_errors_name_the_problem():
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match="num_experts"):
        moe_hf.hf_sources(name)
    assert moe_hf.hf_sources("model.norm.weight") == ["model.norm.weight"]
    keys = moe_hf.hf_sources(name, 2)
    tensors = {k: torch.zeros(3, 4) for k in keys[:3]}
    with pytest.raises(ValueError, match="missing"):
        moe_hf.from_hf(name, tensors)
    full = {k: torch.zeros(3, 4) for k in keys}
    with pytest.raises(ValueError, match="checkpoint has 2 experts"):
        moe_hf.Qwen3MoeHFAdapter(num_experts=4).from_hf(name, full)
    assert moe_hf.from_hf(name, full).shape == (2, 6, 4)


def test_config_json_of_transformers_maps_onto_args(tmp_path):
    args = CONFIGS["sparse_step2_tied"]
    config = transformers.Qwen3MoeConfig(**args.to_hf_dict())
    config.save_pretrained(tmp_path)
    import json

    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in on_disk  # how transformers spells num_experts in files
    parsed = from_options({k: v for k, v in on_disk.items() if k in OPTION_KEYS})
    assert parsed.to_hf_dict() == args.to_hf_dict()
    with pytest.raises(ValueError, match="another name for num_experts"):
        from_options({"num_experts": 4, "num_local_experts": 8})


def test_args_validation_names_keys():
    with pytest.raises(ValueError, match=r"mlp_only_layers\[1\]"):
        from_options({"flavor": "debug", "mlp_only_layers": [0, 5]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        from_options({"flavor": "debug", "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="did you mean 'num_experts'"):
        from_options({"num_expert": 4})
    with pytest.raises(ValueError, match="norm_topk_prob: must be true or false"):
        from_options({"norm_topk_prob": "yes"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3MoeForCausalLM(replace(FLAVORS["debug"], use_sliding_window=True))
    assert from_options({"flavor": "tiny", "router_aux_loss_coef": "1e-3"}).router_aux_loss_coef == 1e-3
    assert from_options({"mlp_only_layers": ["1"], "num_hidden_layers": 2}).mlp_only_layers == [1]


@pytest.mark.procs
def test_spec_and_args_import_no_torch():
    code = (
        "import sys; from meshforge.models.qwen3_moe.spec import FAMILY; "
        "FAMILY.parse_options({'flavor': 'tiny'}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert FAMILY.name == "qwen3_moe" and "num_local_experts" in FAMILY.option_keys


def test_init_meta_build_and_active_flops():
    args = from_options({"flavor": "debug", "pad_token_id": 3, "tie_word_embeddings": False})
    meta = build_qwen3_moe(args, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    model = build_qwen3_moe(args, device="cpu")
    again = build_qwen3_moe(args, device="cpu")
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
        if name.endswith("norm.weight"):
            assert torch.all(p == 1)
        elif name == "model.embed_tokens.weight":
            assert torch.all(p[3] == 0)
        else:
            assert abs(p.std().item() - args.initializer_range) < 0.2 * args.initializer_range, name
    tied = build_qwen3_moe(FLAVORS["debug"], device="meta")
    tied.to_empty(device="cpu")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight

    # Active parameters: each MoE layer uses top_k of its experts.
    block = model.moe_layers()[1]
    expert_params = block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
    inactive = expert_params * (args.num_experts - args.num_experts_per_tok) // args.num_experts
    assert model.num_params(active=True) == model.num_params() - inactive
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    embed = args.vocab_size * args.hidden_size
    attention = 12 * args.num_hidden_layers * args.num_attention_heads * args.attn_head_dim * 64
    expected = 6.0 * (model.num_params() - inactive - embed - norms) + attention
    assert model.flops_per_token(64) == expected


def test_tiny_config_model_section_builds():
    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3_moe", "tiny.yaml")
    with open(path) as f:
        section = yaml.safe_load(f)["model"]
    assert section["model_type"] == FAMILY.name
    options = {k: v for k, v in section.items() if k in OPTION_KEYS}
    args = FAMILY.parse_options(options)
    assert args == FLAVORS["tiny"]
    model = FAMILY.build(options)
    ids = torch.randint(0, args.vocab_size, (1, 4))
    model.to_empty(device="cpu")
    for i, (name, p) in enumerate(model.named_parameters()):
        model.init_full_parameter_(name, p.data, torch.Generator().manual_seed(i))
    logits = model(ids)
    assert torch.isfinite(logits).all() and model.aux_loss() is not None


def test_published_qwen3_30b_a3b_config_gives_its_parameter_counts():
    # config.json of Qwen/Qwen3-30B-A3B (written by transformers 4.51, so `num_experts`).
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    model = FAMILY.build({k: v for k, v in config.items() if k in OPTION_KEYS})
    hidden, layers, experts = 2048, 48, 128
    attention = hidden * 32 * 128 * 2 + hidden * 4 * 128 * 2 + 2 * 128
    expert = 3 * 768 * hidden
    per_layer = attention + experts * hidden + 2 * hidden  # + router + two norms
    embeddings = 2 * 151936 * hidden + hidden  # untied head, final norm
    assert model.num_params() == layers * (per_layer + experts * expert) + embeddings
    assert model.num_params(active=True) == layers * (per_layer + 8 * expert) + embeddings
    # Published: 30.5B parameters in total, 3.3B activated.
    assert round(model.num_params() / 1e9, 1) == 30.5
    assert 3.3e9 <= model.num_params(active=True) < 3.4e9
