"""Built-in Llama against transformers' LlamaForCausalLM, llama3 RoPE, init and option checks."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.models.common.rope import (  # noqa: E402
    RotaryEmbedding,
    default_inv_freq,
    inv_freq_from_parameters,
)
from meshforge.models.llama.args import FLAVORS, LlamaArgs, from_options  # noqa: E402
from meshforge.models.llama.model import LlamaForCausalLM, build_llama  # noqa: E402
from meshforge.models.llama.spec import FAMILY  # noqa: E402
from tests.unit._parity import load_from_hf  # noqa: E402
from tests.unit._parity import rel as _rel  # noqa: E402

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2)
# Wavelengths 2*pi*10000^(i/8) = 6.3, 19.9, 62.8, 199, ...: with L = 64, low 1, high 4 the
# first is kept (< 16), the next two are interpolated (16..64) and the rest divided by 4.
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    # GQA, untied head, head_dim unrelated to hidden/heads.
    "gqa_untied": LlamaArgs(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=12),
    # MHA, tied head, head_dim derived (hidden / heads = 16), attention and MLP biases.
    "mha_tied_bias": LlamaArgs(
        **SMALL,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        pad_token_id=0,
    ),
    # MQA, llama3 RoPE scaling, head_dim larger than hidden / heads.
    "mqa_llama3": LlamaArgs(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters=dict(LLAMA3),
    ),
}


def _pair(args: LlamaArgs, seed: int = 0):
    """A transformers model with random weights (biases and norms too) and ours loaded from it."""
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(**args.to_hf_dict())
    hf_config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ours = LlamaForCausalLM(args)
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
    # Longer than original_max_position_embeddings (64) for the llama3 case.
    seq = 80
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, seq), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, seq), generator=gen)
    labels[0, :5] = -100

    ref = hf(input_ids=ids).logits
    out = ours(ids)
    assert out.shape == ref.shape == (2, seq, args.vocab_size)
    assert _rel(out, ref) <= 1e-5

    losses = []
    for logits in (ref, out):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        losses.append(loss.detach())
    assert _rel(losses[1], losses[0]) <= 1e-5
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours_named = dict(ours.named_parameters())
    assert set(ours_named) == set(hf_grads)
    for n, p in ours_named.items():
        assert p.grad is not None, n
        assert _rel(p.grad, hf_grads[n]) <= 1e-5, n


def test_llama3_inv_freq_is_bitwise_transformers_and_covers_every_band():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = CONFIGS["mqa_llama3"]
    hf_config = transformers.LlamaConfig(**args.to_hf_dict())
    ref, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    ours = inv_freq_from_parameters(args.head_dim, args.rope)
    assert scaling == 1.0 and torch.equal(ours, ref)
    plain = default_inv_freq(args.head_dim, 10_000.0)
    assert ours[0] == plain[0]  # short wavelength: kept
    assert torch.equal(ours[3:], plain[3:] / 4.0)  # long wavelengths: divided by factor
    assert (plain[1:3] / 4.0 < ours[1:3]).all() and (ours[1:3] < plain[1:3]).all()  # interpolated
    # Llama 3.1's published values, against transformers too.
    published = dict(LLAMA3, rope_theta=500_000.0, factor=8.0, original_max_position_embeddings=8192)
    hf_config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=published
    )
    assert torch.equal(inv_freq_from_parameters(128, published), ROPE_INIT_FUNCTIONS["llama3"](hf_config)[0])


def test_llama3_positions_beyond_the_original_context_match_transformers():
    args = CONFIGS["mqa_llama3"]
    hf, ours = _pair(args, seed=2)
    ids = torch.randint(0, args.vocab_size, (2, 24))
    # Positions far past original_max_position_embeddings (64), up to max_position_embeddings.
    positions = torch.stack([torch.arange(24) + 200, torch.arange(24) * 10 + 3])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=positions).logits
        out = ours(ids, position_ids=positions)
        unscaled = LlamaForCausalLM(LlamaArgs(**{**args.to_hf_dict(), "rope_parameters": None}))
        unscaled.load_state_dict(ours.state_dict())
        plain = unscaled(ids, position_ids=positions)
    assert _rel(out, ref) <= 1e-5
    assert _rel(out, plain) > 1e-3  # the scaling really changes the model


def test_default_rope_unchanged_by_the_parameters_path():
    """``RotaryEmbedding(head_dim, theta)`` (qwen3's call) equals the rope_parameters form bitwise."""
    positions = torch.tensor([[0, 5, 17, 1000]])
    old = RotaryEmbedding(16, 1e6)
    new = RotaryEmbedding(16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert old.rope_type == new.rope_type == "default" and old.theta == new.theta == 1e6
    for a, b in zip(
        old(positions, seq_len=4, device=torch.device("cpu"), dtype=torch.float32),
        new(positions, seq_len=4, device=torch.device("cpu"), dtype=torch.float32),
    ):
        assert torch.equal(a, b)
    assert torch.equal(old._inv_freq, 1.0 / (1e6 ** (torch.arange(0, 16, 2).float() / 16)))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "not supported yet: rope_type yarn"),
        ({"type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "not supported yet: rope_type dynamic"),
        ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "low_freq_factor: required"),
        ({"rope_type": "default"}, "rope_theta: missing"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_rope_refuses_what_is_not_built(params, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(16, rope_parameters=params)


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
    assert _rel(out, default) > 1e-3


@pytest.mark.parametrize("name", ["mha_tied_bias", "mqa_llama3"])
def test_packed_documents_equal_separate_runs(name):
    args = CONFIGS[name]
    _, ours = _pair(args, seed=4)
    lengths = [7, 70, 5]  # the middle document runs past the llama3 original context
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
    # Padding (segment 0) gives finite values and finite gradients.
    segment_ids = torch.tensor([[1] * 10 + [0] * 6])
    out = ours(packed[:, :16], segment_ids=segment_ids)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in ours.parameters())


def test_init_full_parameter_statistics_and_determinism():
    args = from_options(
        {
            "flavor": "tiny",
            "pad_token_id": 3,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
        }
    )
    model = build_llama(args, device="meta")
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def draw(fqn: str, seed: int) -> torch.Tensor:
        t = torch.empty(shapes[fqn])
        model.init_full_parameter_(fqn, t, torch.Generator().manual_seed(seed))
        return t

    w = draw("model.layers.1.mlp.up_proj.weight", 7)
    assert abs(w.mean().item()) < 2e-4
    assert abs(w.std().item() - args.initializer_range) < 2e-4
    assert torch.equal(w, draw("model.layers.1.mlp.up_proj.weight", 7))
    assert not torch.equal(w, draw("model.layers.1.mlp.up_proj.weight", 8))
    emb = draw("model.embed_tokens.weight", 1)
    assert torch.count_nonzero(emb[3]) == 0 and torch.count_nonzero(emb[4]) == args.hidden_size
    for fqn in ("model.layers.0.input_layernorm.weight", "model.norm.weight"):
        assert torch.equal(draw(fqn, 0), torch.ones(args.hidden_size))
    for fqn in ("model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.down_proj.bias"):
        assert torch.count_nonzero(draw(fqn, 0)) == 0
    assert abs(draw("lm_head.weight", 2).std().item() - args.initializer_range) < 2e-4
    assert "model.layers.0.self_attn.q_norm.weight" not in shapes
    with pytest.raises(ValueError, match="not a Llama parameter"):
        model.init_full_parameter_("model.rotary_emb.inv_freq", torch.empty(2), torch.Generator())


def test_meta_build_then_materialise_matches_direct_build():
    """The trainer's path: meta -> to_empty -> init each full parameter from its own seed."""
    for flavor in ("debug", "tiny"):
        args = from_options(
            {"flavor": flavor, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96}
        )
        direct = build_llama(args, device="cpu")
        again = build_llama(args, device="cpu")
        lazy = FAMILY.build(
            {"flavor": flavor, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96}
        )
        assert next(lazy.parameters()).device.type == "meta"
        lazy.to_empty(device="cpu")
        for i, (name, param) in enumerate(lazy.named_parameters()):
            lazy.init_full_parameter_(name, param.data, torch.Generator().manual_seed(i))
        assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == args.tie_word_embeddings
        for (name, a), (_, b), (_, c) in zip(
            direct.state_dict().items(), lazy.state_dict().items(), again.state_dict().items()
        ):
            assert torch.equal(a, b) and torch.equal(a, c), name
        ids = torch.randint(0, args.vocab_size, (2, 12))
        assert torch.equal(direct(ids), lazy(ids))


def test_flavors_and_counts():
    tiny = FAMILY.build({"flavor": "tiny"})
    assert tiny.config is tiny.args and tiny.args.rope["rope_type"] == "llama3"
    assert tiny.lm_head.weight is tiny.model.embed_tokens.weight
    a = tiny.args
    per_layer = 2 * a.hidden_size * a.head_dim * (a.num_attention_heads + a.num_key_value_heads)
    per_layer += 3 * a.hidden_size * a.intermediate_size + 2 * a.hidden_size
    expected = a.vocab_size * a.hidden_size + a.num_hidden_layers * per_layer + a.hidden_size
    assert tiny.num_params() == expected
    assert 3_000_000 < expected < 8_000_000
    matmul = a.num_hidden_layers * (per_layer - 2 * a.hidden_size) + a.vocab_size * a.hidden_size
    assert (
        tiny.flops_per_token(128) == 6 * matmul + 12 * a.num_hidden_layers * a.num_attention_heads * 64 * 128
    )
    debug = build_llama(FLAVORS["debug"], device="cpu")
    assert debug.lm_head.weight is not debug.model.embed_tokens.weight
    assert debug.num_params(exclude_embedding=True) == debug.num_params() - 8192 * 64


def test_args_mirror_transformers_defaults_and_hf_round_trip():
    ours, theirs = LlamaArgs(), transformers.LlamaConfig()
    for key, value in ours.to_hf_dict().items():
        assert getattr(theirs, key) == value, key
    # A published Llama 3.1 config.json spells RoPE with rope_theta + rope_scaling.
    legacy = from_options(
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "max_position_embeddings": 131072,
        }
    )
    hf = transformers.LlamaConfig(
        rope_theta=500000.0, rope_scaling=dict(legacy.rope_scaling), max_position_embeddings=131072
    )
    assert legacy.rope == hf.rope_parameters
    assert transformers.LlamaConfig(**legacy.to_hf_dict()).rope_parameters == hf.rope_parameters
    # llama3 without original_max_position_embeddings takes max_position_embeddings, as HF does.
    short = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert (
        from_options({"rope_parameters": short, "max_position_embeddings": 300}).rope[
            "original_max_position_embeddings"
        ]
        == 300
    )


def test_options_overrides_and_refusals():
    assert from_options({"flavor": "tiny", "rope_theta": "1e6"}).rope == {
        "rope_type": "default",
        "rope_theta": 1e6,
    }
    assert from_options({"flavor": "tiny", "hidden_size": 512}).head_dim == 128
    assert from_options({"flavor": "tiny", "hidden_size": 512, "head_dim": 32}).head_dim == 32
    args = from_options({"flavor": "debug", "rms_norm_eps": "1e-5", "num_hidden_layers": "3"})
    assert (args.rms_norm_eps, args.num_hidden_layers) == (1e-5, 3)
    rope = from_options(
        {"rope_parameters": {**LLAMA3, "factor": "8", "original_max_position_embeddings": "64"}}
    ).rope
    assert rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 64
    for bad, match in (
        ({"num_hiden_layers": 2}, "num_hiden_layers.*did you mean 'num_hidden_layers'"),
        ({"flavor": "huge"}, "flavor"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 32}, "num_key_value_heads"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size: must be a multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "not supported yet: rope_type yarn"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "not supported yet: rope_type linear"),
        ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor: must differ"),
        ({"rope_parameters": {**LLAMA3, "factor": True}}, "rope_parameters.factor"),
        ({"rope_parameters": {**LLAMA3, "factor": -1.0}}, "rope_parameters.factor"),
        ({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}, "rope_theta: 1.0 conflicts"),
        ({"rope_parameters": "llama3"}, "rope_parameters: must be a mapping"),
        ({"mlp_bias": "yes"}, "mlp_bias"),
        ({"head_dim": 7}, "head_dim"),
        ({"vocab_size": float("inf")}, "vocab_size"),
        ({"pad_token_id": 100, "vocab_size": 50}, "pad_token_id"),
    ):
        with pytest.raises(ValueError, match=match):
            from_options(bad)
    with pytest.raises(ValueError, match="hidden_act"):
        FAMILY.build({"flavor": "debug", "hidden_act": "tanhh"})


@pytest.mark.procs
def test_options_and_spec_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from meshforge.models.llama.spec import FAMILY; "
        "FAMILY.parse_options({'flavor': 'tiny'}); "
        "assert FAMILY.name == 'llama' and 'mlp_bias' in FAMILY.option_keys; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_example_config_validates_with_the_registered_family():
    from meshforge.config import load_config, validate_config
    from meshforge.models import registry

    assert registry.resolve_family(architectures="LlamaForCausalLM") is FAMILY
    assert registry.resolve_family(model_type="llama") is FAMILY
    path = ROOT / "configs" / "llama" / "tiny.yaml"
    cfg = load_config(path)
    assert validate_config(cfg).errors == []
    options = {k: v for k, v in (cfg.model.model_extra or {}).items()}
    args = FAMILY.parse_options(options)
    assert args.rope["rope_type"] == "llama3" and math.isclose(args.theta, 500_000.0)


def test_save_pretrained_weights_load_by_name(tmp_path):
    """The safetensors keys transformers writes are our parameter names (tied head: embedding only)."""
    from safetensors.torch import load_file

    for name in ("gqa_untied", "mha_tied_bias"):
        args = CONFIGS[name]
        hf, _ = _pair(args, seed=6)
        hf.save_pretrained(tmp_path / name)
        tensors = load_file(tmp_path / name / "model.safetensors")
        ours = LlamaForCausalLM(args)
        result = ours.load_state_dict(tensors, strict=False)
        assert result.unexpected_keys == []
        assert result.missing_keys == (["lm_head.weight"] if args.tie_word_embeddings else [])
        ids = torch.randint(0, args.vocab_size, (1, 16))
        with torch.no_grad():
            assert _rel(ours(ids), hf(input_ids=ids).logits) <= 1e-5


@pytest.mark.procs
def test_example_config_trains_five_steps(tmp_path):
    """configs/llama/tiny.yaml through `meshforge train`."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    code = "import sys; from meshforge.cli.main import main; sys.exit(main(sys.argv[1:]))"
    overrides = [
        "--training.steps=5",
        "--training.local_batch_size=2",
        "--training.global_batch_size=2",
        "--training.log_interval=1",
        f"--training.output_dir={out}",
        "--checkpoint.save_interleaved_steps=5",
        "--model.num_hidden_layers=2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "train",
            "--config",
            str(ROOT / "configs" / "llama" / "tiny.yaml"),
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model: llama" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in records)
    # Uniform over 8192 tokens at init: loss near ln(8192) = 9.01.
    assert abs(records[0]["loss"] - math.log(8192)) < 0.3
    assert (out / "checkpoints" / "checkpoint-00000005" / "COMPLETE").is_file()


def test_hf_folder_round_trip_through_the_checkpoint_adapter(tmp_path):
    """save_pretrained -> meshforge load (identity adapter) -> save_hf -> transformers reload."""
    import json

    from meshforge.checkpoint.hf import hf_adapter, load_hf_weights, save_hf

    args = CONFIGS["mqa_llama3"]
    hf, _ = _pair(args, seed=7)
    hf.save_pretrained(tmp_path / "in")
    # Published Llama 3.1 folders spell RoPE the legacy way: rope_theta + rope_scaling.
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "in" / "config.json").write_text(json.dumps(config))

    options = hf_adapter(FAMILY).from_hf_config(config)
    assert FAMILY.parse_options(options).rope == args.rope
    ours = FAMILY.build(options)
    ours.to_empty(device="cpu")
    load_hf_weights(ours, FAMILY, tmp_path / "in")
    ids = torch.randint(0, args.vocab_size, (2, 90))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert _rel(ours(ids), ref) <= 1e-5
    save_hf(ours, FAMILY, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa")
    assert type(back).__name__ == "LlamaForCausalLM"
    assert back.config.rope_parameters == args.rope
    with torch.no_grad():
        assert _rel(back(input_ids=ids).logits, ref) <= 1e-5
