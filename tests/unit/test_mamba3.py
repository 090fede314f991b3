"""The mamba3 family: the layer against a float64 recurrence written from the paper's equations,
the chunked scan against the token-by-token one, packed documents, the safetensors folder round
trip, options, initialisation and the refusals (CP, bad sizes)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.mamba3.args import FLAVORS, OPTION_KEYS, Mamba3Args, from_options
from meshforge.models.mamba3.model import Mamba3ForCausalLM, build_mamba3
from meshforge.models.mamba3.scan import chunked_scan, document_index, recurrent_scan
from meshforge.models.mamba3.spec import FAMILY
from tests._compare import assert_close, rel_error

SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=8, head_dim=8)
# name -> args: SISO and MIMO, the gated output norm, two B/C groups, the fully rotated state.
CASES = {
    "siso": Mamba3Args(**SMALL, chunk_size=4),
    "siso_outnorm_groups": Mamba3Args(**SMALL, is_outproj_norm=True, n_groups=2, chunk_size=5),
    "mimo": Mamba3Args(**SMALL, is_mimo=True, mimo_rank=3, chunk_size=4),
    "mimo_outnorm_full_rope": Mamba3Args(
        **SMALL, is_mimo=True, mimo_rank=2, is_outproj_norm=True, rope_fraction=1.0, chunk_size=64
    ),
}


def _vary(model: Mamba3ForCausalLM, seed: int = 0) -> None:
    """Biases, norms and MIMO weights start at constants: vary them so a wrong use shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight", "dt_bias")):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("in_proj.weight"):
                p.mul_(20.0)  # larger inputs: decays, trapezoid weights and angles far from their init


def _model(args: Mamba3Args, seed: int = 0) -> Mamba3ForCausalLM:
    torch.manual_seed(seed)
    model = build_mamba3(args, device="cpu")
    _vary(model, seed)
    return model


def _paper_mixer(mixer, x: torch.Tensor, starts: list[set[int]]) -> torch.Tensor:
    """The Mamba-3 layer token by token in float64, from the paper's equations.

    The rotary state is written as complex numbers: entries ``(2j, 2j+1)`` of B and C are one
    complex value, multiplied by ``exp(i theta_t)``. ``starts[b]`` holds the positions where a
    document starts in row ``b`` (the state, the look-back and the angle restart there).
    """
    x = x.double()
    batch, seq, _ = x.shape
    H, P, N, R, G = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.rank, mixer.n_groups
    A = mixer.num_rope_angles
    W = mixer.in_proj.weight.double()
    proj = x @ W.T
    z, xs, b, c, dd_dt, dd_a, trap, ang = proj.split([H * P, H * P, R * G * N, R * G * N, H, H, H, A], -1)
    out = torch.zeros(batch, seq, H * P, dtype=torch.float64)
    eps = mixer.eps

    def rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean() + eps) * w

    for bi in range(batch):
        for h in range(H):
            g = h // (H // G)
            state = torch.zeros(P, N, dtype=torch.float64)
            prev = torch.zeros(P, N, dtype=torch.float64)
            theta = torch.zeros(A, dtype=torch.float64)
            for t in range(seq):
                if t in starts[bi]:
                    state, prev, theta = state * 0, prev * 0, theta * 0
                dt = F.softplus(dd_dt[bi, t, h] + mixer.dt_bias[h].double())
                raw_a = dd_a[bi, t, h]
                a = -max((1 + raw_a) if raw_a >= 0 else 1 / (1 - raw_a), torch.tensor(mixer.A_floor))
                alpha = torch.exp(a * dt)
                lam = torch.sigmoid(trap[bi, t, h])
                theta = theta + math.pi * torch.tanh(ang[bi, t]) * dt
                turn = torch.exp(1j * theta)
                keys, queries, values = [], [], []
                for r in range(R):
                    sl = slice((r * G + g) * N, (r * G + g + 1) * N)
                    kr = rms(b[bi, t, sl], mixer.B_norm.weight.double()) + mixer.B_bias[h, r].double()
                    qr = rms(c[bi, t, sl], mixer.C_norm.weight.double()) + mixer.C_bias[h, r].double()
                    for vec, dest in ((kr, keys), (qr, queries)):
                        pairs = torch.complex(vec[0 : 2 * A : 2], vec[1 : 2 * A : 2]) * turn
                        rotated = vec.clone()
                        rotated[0 : 2 * A : 2], rotated[1 : 2 * A : 2] = pairs.real, pairs.imag
                        dest.append(rotated)
                    v = xs[bi, t, h * P : (h + 1) * P]
                    values.append(v * mixer.mimo_x[h, r].double() if mixer.is_mimo else v)
                cur = sum(torch.outer(values[r], keys[r]) for r in range(R))
                state = alpha * state + (1 - lam) * dt * alpha * prev + lam * dt * cur
                prev = cur
                total = torch.zeros(P, dtype=torch.float64)
                zt = z[bi, t, h * P : (h + 1) * P]
                for r in range(R):
                    y = state @ queries[r] + mixer.D[h].double() * values[r]
                    zr = zt * mixer.mimo_z[h, r].double() if mixer.is_mimo else zt
                    if mixer.is_outproj_norm:
                        y = rms(y, mixer.norm.weight.double()[h * P : (h + 1) * P])
                    y = y * F.silu(zr)
                    total = total + (y * mixer.mimo_o[h, r].double() if mixer.is_mimo else y)
                out[bi, t, h * P : (h + 1) * P] = total
    return out @ mixer.out_proj.weight.double().T


SEGMENTS = torch.tensor([[1] * 5 + [2] * 8 + [3] * 4, [1] * 13 + [0] * 4])
STARTS = [{0, 5, 13}, {0, 13}]


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_equals_the_paper_recurrence_with_document_resets(name):
    mixer = _model(CASES[name]).model.layers[0].mixer
    x = torch.randn(2, 17, 16, generator=torch.Generator().manual_seed(1))
    doc = document_index(SEGMENTS, None, SEGMENTS.shape)
    want = _paper_mixer(mixer, x, STARTS)
    got64 = mixer.double()(x.double(), doc)
    assert rel_error(got64, want) < 1e-12, rel_error(got64, want)
    got32 = mixer.float()(x, doc)
    assert_close(got32, want, what=(name, "float32 chunked scan"))
    if name == "siso":  # without documents: one reset at the row start
        assert rel_error(mixer.double()(x.double()), _paper_mixer(mixer, x, [{0}, {0}])) < 1e-12


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
@pytest.mark.parametrize("rank", [1, 2])
def test_chunked_scan_equals_the_recurrence_values_and_grads(chunk_size, rank):
    g = torch.Generator().manual_seed(chunk_size + 10 * rank)
    batch, seq, heads, n, p = 2, 19, 3, 4, 5
    q, k = (torch.randn(batch, seq, rank, heads, n, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, seq, rank, heads, p, generator=g, dtype=torch.float64)
    adt = -2 * torch.rand(batch, seq, heads, generator=g, dtype=torch.float64)
    dt, lam = (torch.rand(batch, seq, heads, generator=g, dtype=torch.float64) for _ in range(2))
    inputs = [t.requires_grad_() for t in (q, k, v, adt, dt, lam)]
    seg = torch.tensor([[1] * 4 + [2] * 11 + [3] * 4, [1] * 19])
    for doc in (None, document_index(seg, None, seg.shape)):
        want = recurrent_scan(*inputs, doc)
        got = chunked_scan(*inputs, doc, chunk_size=chunk_size)
        assert rel_error(got, want) < 1e-12
        cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
        grads_want = torch.autograd.grad(want, inputs, cot)
        grads_got = torch.autograd.grad(got, inputs, cot)
        for i, (a, b) in enumerate(zip(grads_got, grads_want, strict=True)):
            assert rel_error(a, b) < 1e-11, (i, rel_error(a, b))


def test_packed_documents_equal_separate_runs_by_segments_and_by_positions():
    model = _model(CASES["mimo"]).double()
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(2))
    seg = torch.tensor([[1] * 5 + [2] * 8 + [3] * 4])
    positions = torch.tensor([list(range(5)) + list(range(8)) + list(range(4))])
    packed = model(ids, segment_ids=seg)
    by_positions = model(ids, position_ids=positions)
    alone = torch.cat([model(ids[:, a:b]) for a, b in ((0, 5), (5, 13), (13, 17))], dim=1)
    assert rel_error(packed, alone) < 1e-12
    assert rel_error(by_positions, alone) < 1e-12
    assert rel_error(model(ids), alone) > 1e-3  # without documents the state runs on


def test_model_grads_chunked_equal_recurrent_and_bfloat16_trains():
    model = _model(CASES["siso_outnorm_groups"]).double()
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    grads = []
    for scan in ("chunked", "recurrent"):
        model.zero_grad()
        model.set_scan(scan)
        model(ids, segment_ids=SEGMENTS).logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert rel_error(grad, grads[1][name]) < 1e-10, name
    model = model.to(torch.bfloat16)
    model.set_scan("chunked")
    logits = model(ids, segment_ids=SEGMENTS)
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_init_follows_the_reference():
    args = replace(CASES["mimo"], pad_token_id=3)
    model, again = build_mamba3(args, device="cpu"), build_mamba3(args, device="cpu")
    assert all(p.is_meta for p in build_mamba3(args).parameters())
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
        if name.endswith("dt_bias"):
            dt = F.softplus(p)
            assert dt.min() >= args.dt_min * (1 - 1e-5) and dt.max() <= args.dt_max * (1 + 1e-5), name
        elif name.endswith(("B_bias", "C_bias", ".D", "mimo_z", "norm.weight")):
            assert torch.all(p == 1), name
        elif name.endswith(("mimo_x", "mimo_o")):
            assert torch.allclose(p, torch.full_like(p, 1 / 3)), name
        elif name == "model.embed_tokens.weight":
            assert torch.all(p[3] == 0)
        else:
            assert abs(p.std().item() - args.initializer_range) < 0.3 * args.initializer_range, name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default
    matmul = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.weight"))
    assert model.flops_per_token(32) > 6.0 * (matmul + args.vocab_size * args.hidden_size)


@pytest.mark.parametrize("tied", [True, False])
def test_safetensors_folder_round_trip(tmp_path, tied):
    from safetensors.torch import load_file

    from meshforge.checkpoint.hf import load_hf_weights, save_hf
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict

    args = replace(CASES["mimo_outnorm_full_rope"], tie_word_embeddings=tied)
    model = _model(args).eval()
    out = tmp_path / "folder"
    save_hf(model, FAMILY, out, shard_size="8KB")
    written: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        written.update(load_file(shard))
    assert ("lm_head.weight" in written) is not tied
    assert "backbone.embeddings.weight" in written and "backbone.norm_f.weight" in written
    assert "backbone.layers.1.mixer.in_proj.weight" in written and "backbone.layers.0.mixer.mimo_o" in written
    assert not any(key.startswith("model.") for key in written)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mamba3" and config["architectures"] == ["Mamba3ForCausalLM"]
    assert config["num_heads"] == args.num_heads

    # The folder alone names the family and its options.
    source = resolve_model_source(config_from_dict({"model": {"model_name_or_path": str(out)}}).model)
    assert source.family.name == "mamba3"
    assert FAMILY.parse_options(source.options) == args
    loaded = source.family.build(source.options)
    loaded.to_empty(device="cpu")
    load_hf_weights(loaded, source.family, out)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name


def test_options_and_sizes_are_checked_by_key():
    assert from_options({"flavor": "tiny"}) == FLAVORS["tiny"]
    assert from_options({"flavor": "debug", "num_heads": 4}).num_heads == 4
    assert from_options({"layer_norm_epsilon": 1e-6}).norm_eps == 1e-6  # MindSpeed's spelling
    bad = {
        "head_dim": (dict(hidden_size=16, head_dim=5), "head_dim: must divide"),
        "n_groups": (dict(hidden_size=16, head_dim=8, n_groups=3), "n_groups: must divide"),
        "rope_fraction": (dict(rope_fraction=0.25), "rope_fraction: must be one of"),
        "state_size": (dict(state_size=2), "state_size: .* no rotary pair"),
        "num_heads": (dict(flavor="debug", num_heads=5), "num_heads: 5 disagrees"),
        "unknown": (dict(state_sise=4), "state_sise.*did you mean 'state_size'"),
    }
    for key, (options, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            from_options(options)
            pytest.fail(f"{key}: accepted")
    assert "num_heads" in OPTION_KEYS and "flavor" in OPTION_KEYS


def test_context_parallel_is_refused_by_config_and_by_apply_cp():
    from meshforge.config import config_from_dict
    from meshforge.config.base import ConfigError
    from meshforge.config.rules import cross_section_issues
    from meshforge.parallel.context import apply_cp

    with pytest.raises(
        ConfigError,
        match=r"parallelism\.context_parallel: not supported yet: .* for mamba3: .*set parallelism",
    ):
        config_from_dict({"model": {"model_id": "mamba3"}, "parallelism": {"context_parallel": 2}})
    cfg = config_from_dict({"model": {"model_id": "mamba3"}, "parallelism": {"context_parallel": 1}})
    assert not cross_section_issues(cfg)

    class _Mesh:
        ndim = 1

        def size(self) -> int:
            return 2

    model = FAMILY.build({"flavor": "debug"})
    for method in ("ulysses", "colossal", "kvallgather", "hybrid"):
        with pytest.raises(
            NotImplementedError, match=r"parallelism\.context_parallel > 1 for mamba3: .*set parallelism"
        ):
            apply_cp(model, _Mesh(), method=method)  # type: ignore[arg-type]


def test_tp_plan_refuses_sizes_by_key():
    heads = FAMILY.build({**SMALL, "hidden_size": 12, "head_dim": 8, "expand": 2})  # 3 heads
    with pytest.raises(ValueError, match=r"model\.num_heads \(3\) .*parallelism\.tensor_parallel \(2\)"):
        assert FAMILY.tp_plan is not None
        FAMILY.tp_plan(heads, tp=2, sequence_parallel=False, loss_parallel=False)
    groups = FAMILY.build({**SMALL, "vocab_size": 96, "hidden_size": 24, "head_dim": 4, "n_groups": 4})
    with pytest.raises(ValueError, match=r"model\.n_groups \(4\) .*parallelism\.tensor_parallel \(3\)"):
        FAMILY.tp_plan(groups, tp=3, sequence_parallel=False, loss_parallel=False)


def test_family_resolves_by_every_name():
    from meshforge.models.registry import resolve_family

    for named in ({"model_type": "mamba3"}, {"architectures": "Mamba3ForCausalLM"}, {"model_id": "mamba3"}):
        assert resolve_family(**named) is FAMILY


def test_tiny_config_model_section_builds():
    import yaml

    from tests.conftest import REPO

    section = yaml.safe_load((REPO / "configs" / "mamba3" / "tiny.yaml").read_text())["model"]
    assert section["model_type"] == FAMILY.name
    options = {k: v for k, v in section.items() if k in OPTION_KEYS}
    assert FAMILY.parse_options(options) == FLAVORS["tiny"]
