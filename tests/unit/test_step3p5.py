"""Built-in Step-3.5 against a float64 reference written here from the published modelling code
(stepfun-ai/Step-3.5-Flash ``modeling_step3p5.py``; transformers has no Step-3.5): one layer of
each kind and the whole model (logits, loss, gradients), the published checkpoint key names and
an HF folder round trip, the published config.json, args."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.step3p5.args import FLAVORS, Step3p5Args, from_options
from meshforge.models.step3p5.model import Step3p5ForCausalLM, build_step3p5
from meshforge.models.step3p5.spec import FAMILY
from tests.unit._parity import rel

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
# Full (half-rotary, theta 5e6, llama3-scaled, 4 heads / 2 kv) then sliding (window 5, 6 heads /
# 3 kv, full rotary) layers; layer 0 dense, 1-2 sparse; clamps on layer 2; head-wise gate.
ARGS = Step3p5Args(
    vocab_size=80,
    hidden_size=24,
    intermediate_size=40,
    num_attention_heads=4,
    num_attention_groups=2,
    num_hidden_layers=3,
    head_dim=8,
    max_position_embeddings=64,
    moe_intermediate_size=12,
    moe_num_experts=5,
    moe_top_k=2,
    moe_router_scaling_factor=2.5,
    share_expert_dim=16,
    moe_layers_enum="1,2",
    rope_theta=[5_000_000.0, 10_000.0, 500.0, 1.0],
    rope_scaling=LLAMA3,
    yarn_only_types=["full_attention"],
    partial_rotary_factors=[0.5, 1.0, 1.0, 1.0],
    layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=5,
    attention_other_setting={"num_attention_heads": 6, "num_attention_groups": 3},
    use_head_wise_attn_gate=True,
    swiglu_limits=[0.0, 0.0, 0.05, 0.0],
    swiglu_limits_shared=[0.0, None, 0.04, 0.0],
    num_nextn_predict_layers=1,
)


def _model(args: Step3p5Args = ARGS, seed: int = 0) -> Step3p5ForCausalLM:
    model = build_step3p5(args, device="cpu").double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router_bias")):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model


# --- the reference, from the published modelling code -------------------------------------------


def ref_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + 1)


def ref_inv_freq(dim, theta, scaling):
    # float32, as the published rotary embedding computes its table (the model then casts cos/sin).
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv
    # transformers' _compute_llama3_parameters, which the published rotary embedding calls.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def ref_rope(q, positions, dim, theta, scaling):
    freqs = positions[:, None].float() * ref_inv_freq(dim, theta, scaling)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().double(), emb.sin().double()
    rot, rest = q[..., :dim], q[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def ref_swiglu(x, gate_w, up_w, down_w, limit):
    gate, up = F.silu(x @ gate_w.T), x @ up_w.T
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (gate * up) @ down_w.T


def ref_layer(p, i, x, args):
    """Step3p5DecoderLayer.forward for a [S, hidden] sequence; ``p`` maps published names to tensors."""
    pre = f"model.layers.{i}."
    seq = x.shape[0]
    kind = args.layer_types[i]
    heads, kv = (6, 3) if kind == "sliding_attention" else (4, 2)
    d = args.head_dim
    h = ref_norm(x, p[pre + "input_layernorm.weight"], args.rms_norm_eps)
    q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(seq, heads, d)
    k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(seq, kv, d)
    v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(seq, kv, d)
    q = ref_norm(q, p[pre + "self_attn.q_norm.weight"], args.rms_norm_eps)
    k = ref_norm(k, p[pre + "self_attn.k_norm.weight"], args.rms_norm_eps)
    dim = int(d * args.partial_rotary_factors[i])
    scaling = args.rope_scaling if kind in args.yarn_only_types else None
    positions = torch.arange(seq)
    q = ref_rope(q.transpose(0, 1), positions, dim, args.rope_theta[i], scaling)
    k = ref_rope(k.transpose(0, 1), positions, dim, args.rope_theta[i], scaling)
    k = k.repeat_interleave(heads // kv, dim=0)
    v = v.transpose(0, 1).repeat_interleave(heads // kv, dim=0)
    scores = q @ k.transpose(1, 2) * d**-0.5
    qi, kj = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = kj <= qi
    if kind == "sliding_attention":
        allowed &= qi - kj < args.sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1)  # [S, heads, d]
    out = out * torch.sigmoid(h @ p[pre + "self_attn.g_proj.weight"].T)[..., None]
    x = x + out.reshape(seq, -1) @ p[pre + "self_attn.o_proj.weight"].T
    h = ref_norm(x, p[pre + "post_attention_layernorm.weight"], args.rms_norm_eps)
    shared_limit = args.swiglu_limits_shared[i]
    if i not in args.moe_layers:
        mlp = [p[pre + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
        return x + ref_swiglu(h, *mlp, shared_limit)
    prob = torch.sigmoid(h @ p[pre + "moe.gate.weight"].T)
    _, idx = torch.topk(prob + p[pre + "moe.router_bias"], args.moe_top_k, dim=1)
    weights = prob.gather(1, idx)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * args.moe_router_scaling_factor
    routed = torch.zeros_like(h)
    for t in range(seq):
        for slot in range(args.moe_top_k):
            e = int(idx[t, slot])
            expert = [p[pre + f"moe.{n}_proj.weight"][e] for n in ("gate", "up", "down")]
            routed[t] += weights[t, slot] * ref_swiglu(h[t], *expert, args.swiglu_limits[i])
    shared = [p[pre + f"share_expert.{n}_proj.weight"] for n in ("gate", "up", "down")]
    return x + routed + ref_swiglu(h, *shared, shared_limit)


def ref_logits(p, ids, args):
    out = []
    for row in ids:
        x = p["model.embed_tokens.weight"][row]
        for i in range(args.num_hidden_layers):
            x = ref_layer(p, i, x, args)
        out.append(ref_norm(x, p["model.norm.weight"], args.rms_norm_eps) @ p["lm_head.weight"].T)
    return torch.stack(out)


def published(model: Step3p5ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under the published checkpoint names (through the family's adapter)."""
    adapter = FAMILY.hf_adapter(model.args)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out.update(adapter.to_hf(name, param.detach()))
    return out


# --- tests ---------------------------------------------------------------------------------------


def test_each_layer_kind_equals_the_float64_reference():
    model = _model()
    p = published(model)
    x = torch.randn(2, 11, ARGS.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    masks = {
        "full_attention": torch.ones(11, 11, dtype=torch.bool).tril()[None, None],
        "sliding_attention": (torch.ones(11, 11, dtype=torch.bool).tril().triu(-4))[None, None],
    }
    kinds = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            kinds.append((layer.attention_type, layer.is_moe))
            got = layer(x, None, masks)
            want = torch.stack([ref_layer(p, i, row, ARGS) for row in x])
            assert rel(got, want) <= 1e-12, i
    assert kinds == [("full_attention", False), ("sliding_attention", True), ("full_attention", True)]
    # The clamps of layer 2 are active on these inputs (otherwise the check above proves nothing).
    layer = model.model.layers[2]
    h = layer.post_attention_layernorm(x)
    assert (F.silu(layer.share_expert.gate_proj(h)) > 0.04).any()


def test_logits_loss_and_gradients_equal_the_reference():
    model = _model(seed=3)
    ids = torch.randint(0, ARGS.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, ARGS.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    logits = model(ids)
    names = dict(model.named_parameters())
    p = {k: v.detach().clone().requires_grad_(True) for k, v in published(model).items()}
    want = ref_logits(p, ids, ARGS)
    assert rel(logits, want) <= 1e-12
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref_loss = F.cross_entropy(want.flatten(0, 1), labels.flatten(), reduction="sum")
    assert rel(loss, ref_loss) <= 1e-12
    loss.backward()
    ref_loss.backward()
    adapter = FAMILY.hf_adapter(ARGS)
    for name, param in names.items():
        if not param.requires_grad:
            assert name.endswith("router_bias")
            continue
        sources = adapter.hf_sources(name)
        ref_grad = adapter.from_hf(name, {k: p[k].grad for k in sources})
        assert rel(param.grad, ref_grad) <= 1e-10, name
    assert model.aux_loss() is None and sorted(model.tokens_per_expert()) == [1, 2]


def test_packed_documents_equal_separate_runs():
    model = _model(seed=6)
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randint(0, 80, (1, 9), generator=gen), torch.randint(0, 80, (1, 6), generator=gen)
    with torch.no_grad():
        out = model(torch.cat([a, b], 1), segment_ids=torch.tensor([[1] * 9 + [2] * 6]))
        assert rel(out[:, :9], model(a)) <= 1e-12
        assert rel(out[:, 9:], model(b)) <= 1e-12


def test_published_key_names_and_mtp_layers_ignored():
    model = build_step3p5(ARGS, device="meta")
    keys = set(published(model))
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(3):
        pre = f"model.layers.{i}."
        expected |= {pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"}
        attn = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "q_norm", "k_norm")
        expected |= {f"{pre}self_attn.{n}.weight" for n in attn}
        if i == 0:
            expected |= {f"{pre}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        else:
            expected |= {f"{pre}moe.{n}_proj.weight" for n in ("gate", "up", "down")}
            expected |= {pre + "moe.gate.weight", pre + "moe.router_bias"}
            expected |= {f"{pre}share_expert.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert keys == expected
    shapes = {k: tuple(v.shape) for k, v in published(model).items()}
    assert shapes["model.layers.1.moe.gate_proj.weight"] == (5, 12, 24)
    assert shapes["model.layers.1.moe.down_proj.weight"] == (5, 24, 12)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (48, 24)  # 6 sliding heads
    assert FAMILY.hf_adapter(ARGS).ignored_keys[0] == "model.layers.3.*"  # the MTP layer


def test_hf_folder_round_trip_with_published_names(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file, save_file

    from meshforge.checkpoint.hf import hf_adapter, load_hf_weights, read_hf_config, save_hf

    source = _model(seed=8).float()
    src = tmp_path / "src"
    src.mkdir()
    tensors = {k: v.contiguous() for k, v in published(source).items()}
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(2, 2)  # an MTP layer's key
    save_file(tensors, src / "model.safetensors")
    config = {"model_type": "step3p5", "architectures": ["Step3p5ForCausalLM"], **ARGS.to_hf_dict()}
    config.update(max_seq_len=64, moe_every_n_layer=1, torch_dtype="float32")  # read by nobody
    (src / "config.json").write_text(json.dumps(config))

    options = hf_adapter(FAMILY).from_hf_config(read_hf_config(src))
    model = FAMILY.build(options, device="meta")
    assert model.args == ARGS
    model.to_empty(device="cpu")
    load_hf_weights(model, FAMILY, src)
    ids = torch.randint(0, 80, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel(model(ids), source(ids)) <= 1e-6
    out = tmp_path / "export"
    save_hf(model, FAMILY, out)
    written = {}
    for path in out.glob("*.safetensors"):
        written.update(load_file(path))
    del tensors["model.layers.3.self_attn.q_proj.weight"]
    assert set(written) == set(tensors)
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)
    assert json.loads((out / "config.json").read_text())["model_type"] == "step3p5"


def test_published_config_json_builds_196b_11b_active():
    from meshforge.models.step3p5.hf import from_hf_config

    # The shape-bearing fields of stepfun-ai/Step-3.5-Flash's config.json (45 layers + 3 MTP).
    layers = (["full_attention"] + ["sliding_attention"] * 3) * 12
    published_cfg = {
        "model_type": "step3p5",
        "hidden_size": 4096,
        "intermediate_size": 11264,
        "num_attention_heads": 64,
        "num_attention_groups": 8,
        "num_hidden_layers": 45,
        "head_dim": 128,
        "vocab_size": 128896,
        "moe_num_experts": 288,
        "moe_top_k": 8,
        "moe_intermediate_size": 1280,
        "share_expert_dim": 1280,
        "moe_layers_enum": ",".join(str(i) for i in range(3, 45)),
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "use_moe_router_bias": True,
        "layer_types": layers,
        "sliding_window": 512,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 96,
            "num_attention_groups": 8,
            "head_dim": 128,
        },
        "rope_theta": [5e6 if k == "full_attention" else 1e4 for k in layers],
        "partial_rotary_factors": [0.5 if k == "full_attention" else 1.0 for k in layers],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "original_max_position_embeddings": 131072,
            "low_freq_factor": 1.0,
            "high_freq_factor": 32.0,
        },
        "yarn_only_types": ["full_attention"],
        "use_head_wise_attn_gate": True,
        "num_nextn_predict_layers": 3,
        "max_position_embeddings": 262144,
        "max_seq_len": 262144,
    }
    args = from_options(from_hf_config(published_cfg))
    model = build_step3p5(args, device="meta")
    total, active = model.num_params(), model.num_params(exclude_embedding=True, active=True)
    assert 190e9 < total < 200e9 and 10e9 < active < 12e9  # "196B total, 11B active"
    assert args.layer_heads(1) == (96, 8) and args.rotary_dim(0) == 64 and args.layer_rope_scaling(1) is None


def test_args_refuse_bad_values_by_name():
    base = {"flavor": "tiny"}
    assert from_options({**base, "share_expert_dims": 64}).share_expert_dim == 64
    bad = {
        "layer_types": (["full_attention"] * 3, "layer_types: must be a list with one entry per layer"),
        "moe_layers_enum": ("1,9", "moe_layers_enum: layer 9 is not in"),
        "rope_scaling": ({"rope_type": "yarn", "factor": 2.0}, "rope_scaling.rope_type: not supported yet"),
        "moe_router_activation": ("softmax", None),
        "use_rope_layers": ([True, False, True, True], "use_rope_layers: not supported yet"),
        "sink": (True, "sink: not supported yet"),
        "attention_other_setting": ({"num_attention_heads": 6, "num_attention_groups": 4}, "must divide"),
        "moe_num_expert": (8, "did you mean 'moe_num_experts'"),
    }
    for key, (value, message) in bad.items():
        options = {**base, key: value}
        if key == "moe_router_activation":
            options["use_moe_router_bias"] = False
            message = "moe_router_activation: not supported yet"
        with pytest.raises(ValueError, match=message):
            from_options(options)


def test_init_tiny_config_and_registry():
    import yaml

    from meshforge.models.registry import resolve_family
    from meshforge.models.step3p5.args import OPTION_KEYS

    assert resolve_family(model_id="step35") is FAMILY is resolve_family(model_type="step3p5")
    path = Path(__file__).resolve().parents[2] / "configs" / "step3p5" / "tiny.yaml"
    section = yaml.safe_load(path.read_text())["model"]
    assert FAMILY.parse_options({k: v for k, v in section.items() if k in OPTION_KEYS}) == FLAVORS["tiny"]
    model = build_step3p5(FLAVORS["tiny"], device="cpu")
    assert model.model.layers[1].moe.router_bias.eq(0).all()
    assert model.model.norm.weight.eq(0).all()  # zero-centred: scale 1 + 0
    assert 0.015 < float(model.model.layers[1].moe.experts.gate_up_proj.detach().std()) < 0.025
    logits = model(torch.randint(0, 8192, (1, 70)))  # longer than the 64-token window
    assert torch.isfinite(logits).all() and sorted(model.tokens_per_expert()) == [1, 2, 3]
    bf16 = replace(
        FLAVORS["tiny"],
        num_hidden_layers=2,
        moe_layers_enum="1",
        vocab_size=256,
        hidden_size=64,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        share_expert_dim=32,
    )
    small = build_step3p5(bf16, device="cpu").to(torch.bfloat16)
    small(torch.randint(0, 256, (1, 9))).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in small.parameters() if p.requires_grad)


def test_context_parallel_is_refused_before_any_model_is_built():
    from meshforge.config import load_config
    from meshforge.config.base import ConfigError

    path = Path(__file__).resolve().parents[2] / "configs" / "step3p5" / "tiny.yaml"
    with pytest.raises(ConfigError, match="parallelism.context_parallel: not supported yet: .* for step3p5"):
        load_config(str(path), ["--parallelism.context_parallel=2"])
    assert load_config(str(path), []).model.model_type == "step3p5"


def test_pipeline_stage_finds_the_sparse_blocks():
    from meshforge.parallel.pipeline import split_model

    model = build_step3p5(FLAVORS["tiny"], device="cpu")
    split = split_model(model, pp_rank=1, pp_size=2, layers_per_stage=None, interleave=1, schedule="1f1b")
    blocks = split.model.moe_layers()
    assert sorted(blocks) == [2, 3] and all(
        b is split.model.model.layers[str(i)].moe for i, b in blocks.items()
    )
    assert 0 < split.model.num_params(active=True) < split.model.num_params()
