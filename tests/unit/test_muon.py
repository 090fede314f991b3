"""`optimizer.type: Muon` on one process: torch.optim.Muon's update, the split, resume, bad inputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from meshforge.checkpoint.manager import CheckpointManager
from meshforge.optim.build import build_optimizer
from meshforge.optim.muon import MeshMuon, newton_schulz
from meshforge.optim.muon_split import split_muon, takes_muon
from meshforge.utils.seed import rng_state
from tests._compare import rel_error

COEFFS = (3.4445, -4.775, 2.0315)


class TinyLM(nn.Module):
    """HF names: embeddings, attention/MLP projections, norms, a router and fused experts, lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, 8)
        layer = nn.Module()
        layer.input_layernorm = nn.LayerNorm(8)
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = nn.Linear(8, 12, bias=True)
        layer.self_attn.o_proj = nn.Linear(12, 8, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate = nn.Linear(8, 3, bias=False)
        layer.mlp.experts = nn.Module()
        layer.mlp.experts.gate_up_proj = nn.Parameter(torch.randn(3, 10, 8) * 0.2)
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        layer = self.model.layers[0]
        h = self.model.embed_tokens(ids)
        h = h + layer.self_attn.o_proj(torch.tanh(layer.self_attn.q_proj(layer.input_layernorm(h))))
        weights = torch.softmax(layer.mlp.gate(h), dim=-1)
        experts = torch.einsum("bh,eoh->beo", h, layer.mlp.experts.gate_up_proj)[..., :8]
        h = h + (weights.unsqueeze(-1) * experts).sum(1)
        return self.lm_head(h)


def _build(model: nn.Module, **options: object) -> torch.optim.Optimizer:
    return build_optimizer(
        model.named_parameters(),
        type="Muon",
        learning_rate=0.02,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        weight_decay_include=None,
        weight_decay_exclude=None,
        options=options,
    )


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 16, (6,), generator=gen)
    return nn.functional.cross_entropy(model(ids), torch.randint(0, 16, (6,), generator=gen))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_split_rule() -> None:
    split = split_muon(TinyLM().named_parameters())
    assert [n for n, _ in split.muon] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    assert "model.layers.0.mlp.gate.weight" in [n for n, _ in split.adamw]  # router
    assert not takes_muon("model.layers.0.mlp.gate_proj.weight", 1)
    assert takes_muon("model._orig_mod.layers.0.mlp.gate_proj.weight", 2)
    assert not takes_muon("model.layers.0.linear_attn.conv1d.weight", 3)
    assert not takes_muon("output.weight", 2) and not takes_muon("transformer.wte.weight", 2)


def test_newton_schulz_bf16_is_torchs() -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in ((12, 8), (8, 12)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
        ours = newton_schulz(g, COEFFS, 5, 1e-7, torch.bfloat16)
        assert torch.equal(ours, _zeropower_via_newtonschulz(g, COEFFS, 5, 1e-7)), shape


def test_newton_schulz_float32_against_float64_and_batched() -> None:
    g = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(4))
    ours = newton_schulz(g, COEFFS, 5, 1e-7, torch.float32)
    for e in range(3):
        ref = newton_schulz(g[e].double(), COEFFS, 5, 1e-7, torch.float64)
        assert rel_error(ours[e], ref) < 1e-5
    # The quintic pushes singular values towards 1 (into about [0.7, 1.2] after 5 steps).
    s = torch.linalg.svdvals(ours[0].double())
    assert s.min() > 0.5 and s.max() < 1.5


@pytest.mark.parametrize("match", [False, True])
def test_one_process_update_is_torch_optim_muon(match: bool) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = _build(model, ns_bfloat16=True, match_rms_adamw=match, momentum=0.9)
    assert isinstance(opt, MeshMuon)
    muon_names = {n for n, _ in split_muon(ref.named_parameters()).muon}
    # torch takes 2-D parameters only: the expert weight is compared through its own copy below.
    two_d = [p for n, p in ref.named_parameters() if n in muon_names and p.dim() == 2]
    others = [p for n, p in ref.named_parameters() if n not in muon_names]
    fn = "match_rms_adamw" if match else "original"
    ref_muon = torch.optim.Muon(two_d, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=fn)
    decay = [p for p in others if p.dim() >= 2]
    ref_adam = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=0.02,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    experts = ref.model.layers[0].mlp.experts.gate_up_proj
    expert_opts = [
        torch.optim.Muon(
            [nn.Parameter(experts.detach()[e].clone())],
            lr=0.02,
            weight_decay=0.1,
            momentum=0.9,
            adjust_lr_fn=fn,
        )
        for e in range(3)
    ]
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _loss(ref, step).backward()
        for e, eo in enumerate(expert_opts):
            (mat,) = eo.param_groups[0]["params"]
            mat.grad = experts.grad[e].clone()
            eo.step()
        ref_muon.step()
        ref_adam.step()
        ref_muon.zero_grad(set_to_none=True)
        ref_adam.zero_grad(set_to_none=True)
        with torch.no_grad():
            experts.copy_(torch.stack([eo.param_groups[0]["params"][0] for eo in expert_opts]))
            experts.grad = None
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel_error(got, want) < 1e-6, name


def test_resume_is_bitwise() -> None:
    torch.manual_seed(1)
    model = TinyLM()
    opt = _build(model)
    _train(model, opt, range(2))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, range(2, 4))
    again = TinyLM()
    again.load_state_dict(saved_model)
    opt2 = _build(again)
    opt2.load_state_dict(saved_opt)
    _train(again, opt2, range(2, 4))
    for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name


def _manager(folder: Path) -> CheckpointManager:
    return CheckpointManager(
        save_dir=folder,
        prefix="checkpoint",
        interval=None,
        keep=None,
        enabled=True,
        save_optimizer=True,
        rank=0,
    )


def test_checkpoint_type_mismatch_names_optimizer_type(tmp_path: Path) -> None:
    model = TinyLM()
    adamw = build_optimizer(
        model.named_parameters(),
        type="AdamW",
        learning_rate=0.02,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        weight_decay_include=None,
        weight_decay_exclude=None,
        options={},
    )
    _train(model, adamw, range(1))
    step = _manager(tmp_path / "a").save(1, model, adamw, {"step": 1}, rng_state())
    muon = _build(model)
    with pytest.raises(ValueError, match="holds AdamW optimizer state, but optimizer.type is Muon"):
        _manager(tmp_path / "a").load(step, model, muon, load_optimizer=True)
    _manager(tmp_path / "a").load(step, model, muon, load_optimizer=False)  # weights only: fine
    _train(model, muon, range(1))
    step = _manager(tmp_path / "m").save(1, model, muon, {"step": 1}, rng_state())
    with pytest.raises(ValueError, match="holds Muon optimizer state, but optimizer.type is AdamW"):
        _manager(tmp_path / "m").load(step, model, adamw, load_optimizer=True)
    resumed = _build(model)
    _manager(tmp_path / "m").load(step, model, resumed, load_optimizer=True)
    assert all(torch.equal(a, b) for a, b in zip(_bufs(resumed), _bufs(muon), strict=True))


def _bufs(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"] for g in opt.param_groups if g["muon"] for p in g["params"]]


class NoMatrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(4, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("model", "options", "fragment"),
    [
        (NoMatrices(), {}, "optimizer.type: Muon needs 2-D hidden weight matrices"),
        (
            TinyLM(),
            {"ns_coefficients": [3.4, -4.7]},
            "optimizer.ns_coefficients: expected a list of three numbers",
        ),
        (
            TinyLM(),
            {"ns_coefficients": [3.4, "x", 2.0]},
            "optimizer.ns_coefficients: item [1]: expected a number",
        ),
        (
            TinyLM(),
            {"ns_coefficients": [-3.4, 4.7, 2.0]},
            "optimizer.ns_coefficients: expected three finite numbers",
        ),
        (TinyLM(), {"ns_steps": 0}, "optimizer.ns_steps: must be in [1, 100)"),
        (TinyLM(), {"momentum": 1.0}, "optimizer.momentum: must be in [0, 1)"),
        (
            TinyLM(),
            {"ns_stpes": 5},
            "optimizer.ns_stpes: unknown key for optimizer type Muon; did you mean 'ns_steps'?",
        ),
    ],
)
def test_bad_inputs_name_the_key(model: nn.Module, options: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        _build(model, **options)
    assert fragment in str(err.value)


def test_group_layout_and_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="meshforge.optim.build"):
        opt = _build(TinyLM())
    assert [g["muon"] for g in opt.param_groups] == [True, True, False, False]
    assert [len(g["params"]) for g in opt.param_groups] == [3, 0, 3, 3]
    text = caplog.text
    assert "Muon on 3 tensors" in text and "model.layers.{*}.mlp.experts.gate_up_proj" in text
    assert "AdamW on 6 tensors" in text and "model.layers.{*}.mlp.gate.weight" in text


def test_mindspeed_optimizer_muon_imports_and_is_trainable(tmp_path: Path) -> None:
    from meshforge.config import ConfigError, check_trainable, config_from_dict
    from meshforge.config.loader import dump_yaml, load_native_dict, validate_imported

    flat = {
        "model": {"model_name_or_path": "/models/tiny", "model_id": "qwen3"},
        "training": {"output_dir": "./out", "max_steps": 3, "optimizer": "muon"},
    }
    path = tmp_path / "ms.yaml"
    path.write_text(dump_yaml(flat), encoding="utf-8")
    origins: dict[str, tuple[str, object]] = {}
    data, _, _ = load_native_dict(path, (), fmt="mindspeed", log=lambda _: None, origins=origins)
    validate_imported(data, origins, source=str(path))
    assert data["optimizer"]["type"] == "Muon"
    loader = {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}
    section = {"type": "Muon", "momentum": 0.9, "ns_coefficients": [3, -4, 2]}
    check_trainable(
        config_from_dict(
            {"model": {"model_type": "qwen3"}, "train_dataset": {"dataloader": loader}, "optimizer": section}
        )
    )
    with pytest.raises(ConfigError) as err:  # a bad passthrough key is reported at load time
        check_trainable(
            config_from_dict(
                {
                    "model": {"model_type": "qwen3"},
                    "train_dataset": {"dataloader": loader},
                    "optimizer": {"type": "muon", "ns_coefficients": [3, -4]},
                }
            )
        )
    assert "optimizer.ns_coefficients" in [p for p, _ in err.value.issues]
