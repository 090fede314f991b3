"""float8 / MXFP8 training of linear layers (`model.quant_*`, `parallel/float8.py`): the key
checks, the device rules, which modules are converted, and tiny emulated training on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from meshforge.config import ConfigError, config_from_dict
from meshforge.config.checks import validate_config
from meshforge.parallel.float8 import (
    FLOAT8_CONVERTER,
    MX_CONVERTER,
    apply_quantization,
    check_quant_device,
    quant_settings,
)

BASE = {
    "model": {"model_type": "qwen3"},
    "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
    "context": {"device_target": "cpu"},
}


def _settings(**model: object):
    # The section alone: a whole config with bad keys already fails to load (the last test).
    from meshforge.models.config import ModelConfig

    return quant_settings(ModelConfig.model_validate({"model_type": "qwen3", **model}))


def test_the_converter_follows_the_recipe_unless_written() -> None:
    assert _settings() is None
    mx = _settings(quant_recipe_name="mxfp8")
    assert mx is not None and mx.converter == MX_CONVERTER and mx.kind == "mx"
    assert mx.apply_modules == ["model.layers.{*}"] and mx.ignored_modules == ["*lm_head", "*gate"]
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        s = _settings(quant_recipe_name=recipe)
        assert s is not None and s.converter == FLOAT8_CONVERTER and s.kind == "float8"
    s = _settings(quant_recipe_name="rowwise", quant_converters=["quantize.linear.float8"])
    assert s is not None and s.converter == FLOAT8_CONVERTER


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        (
            {"quant_recipe_name": "tensorwise", "quant_converters": ["quantize.linear.mx"]},
            "model.quant_converters: ['quantize.linear.mx'] does not fit model.quant_recipe_name=tensorwise",
        ),
        (
            {"quant_recipe_name": "mxfp8", "quant_converters": ["quantize.linear.fp4"]},
            "model.quant_converters[0]: unknown converter 'quantize.linear.fp4'",
        ),
        (
            {"quant_recipe_name": "mxfp8", "quant_converters": ["quantize.linear.mx", "quantize.moe.mx"]},
            "not supported yet: model.quant_converters[1]=quantize.moe.mx",
        ),
        (
            {"quant_recipe_name": "mxfp8", "quant_apply_modules": ["model.layers.{x}"]},
            "model.quant_apply_modules[0]: module pattern 'model.layers.{x}': unrecognised brace",
        ),
    ],
)
def test_bad_keys_name_the_key(model: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        _settings(**model)
    assert fragment in str(err.value)


def test_companions_without_a_recipe_are_warned() -> None:
    cfg = config_from_dict({**BASE, "model": {"model_type": "qwen3", "quant_ignored_modules": ["*lm_head"]}})
    warned = [w for w in validate_config(cfg).warnings if w[0] == "model.quant_ignored_modules"]
    assert warned and "no effect without model.quant_recipe_name" in warned[0][1]


def test_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    mx, f8 = _settings(quant_recipe_name="mxfp8"), _settings(quant_recipe_name="rowwise")
    assert mx is not None and f8 is not None
    assert check_quant_device(mx, torch.device("cpu")) is True  # torchao's emulation
    with pytest.raises(ValueError, match=r"model\.quant_recipe_name=mxfp8: needs a CUDA GPU .* xpu has no"):
        check_quant_device(mx, torch.device("xpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    assert check_quant_device(f8, torch.device("cuda")) is False  # Hopper runs float8
    with pytest.raises(
        ValueError, match=r"mxfp8: this GPU \(NVIDIA H200, sm90\) cannot run it; it needs sm100\+"
    ):
        check_quant_device(mx, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (8, 0))
    with pytest.raises(
        ValueError, match=r"rowwise: this GPU \(NVIDIA H200, sm80\) cannot run it; it needs sm89\+"
    ):
        check_quant_device(f8, torch.device("cuda"))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.odd = nn.Linear(64, 40, bias=False)  # 40 is not a multiple of 16 or 32
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(64, 32, bias=False)  # a router: *gate
        self.mlp.gate_proj = nn.Linear(64, 128, bias=False)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(64, 128, bias=False)


# Importing torchao takes ~7 s (it probes CUDA extensions): the tests that convert are slow.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_module_selection(recipe: str) -> None:
    settings = _settings(quant_recipe_name=recipe)
    assert settings is not None
    with torch.device("meta"):
        model = _Tiny()
    before = {n: p for n, p in model.named_parameters()}
    plan = apply_quantization(model, settings, device=torch.device("cpu"), fsdp=False, fsdp_backend=None)
    assert plan.converted == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.gate_proj", "q_proj")]
    assert plan.skipped == ["model.layers.0.odd", "model.layers.1.odd"] and plan.emulated
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate) is nn.Linear
    assert type(model.model.layers[0].q_proj) is not nn.Linear
    # The same parameters under the same names: init, checkpoints and HF export are unchanged.
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    assert "14" not in plan.summary() and f"4 linear layers through {settings.converter}" in plan.summary()


def test_patterns_that_select_nothing_are_errors() -> None:
    with torch.device("meta"):
        model = _Tiny()
    nothing = _settings(quant_recipe_name="rowwise", quant_apply_modules=["model.decoder.{*}"])
    assert nothing is not None
    with pytest.raises(
        ValueError, match=r"model\.quant_apply_modules\[0\]: pattern 'model.decoder.\{\*\}' matches no module"
    ):
        apply_quantization(model, nothing, device=torch.device("cpu"), fsdp=False, fsdp_backend=None)
    all_ignored = _settings(quant_recipe_name="rowwise", quant_ignored_modules=["*proj", "*gate"])
    assert all_ignored is not None
    with pytest.raises(ValueError, match=r"model\.quant_apply_modules: .* selects no nn\.Linear"):
        apply_quantization(model, all_ignored, device=torch.device("cpu"), fsdp=False, fsdp_backend=None)


@pytest.mark.slow
def test_all_gather_notes_only_for_a_written_key() -> None:
    with torch.device("meta"):
        model = _Tiny()
    written = _settings(quant_recipe_name="rowwise", enable_fsdp_low_precision_all_gather=True)
    assert written is not None
    plan = apply_quantization(model, written, device=torch.device("cpu"), fsdp=True, fsdp_backend="gloo")
    assert not plan.fsdp_all_gather and "tensorwise recipe only" in plan.notes[0]
    with torch.device("meta"):
        model = _Tiny()
    tensorwise = _settings(quant_recipe_name="tensorwise", enable_fsdp_low_precision_all_gather=True)
    assert tensorwise is not None
    plan = apply_quantization(model, tensorwise, device=torch.device("cpu"), fsdp=True, fsdp_backend="gloo")
    assert not plan.fsdp_all_gather and "no effect on gloo" in plan.notes[0]
    with torch.device("meta"):
        model = _Tiny()
    default = _settings(quant_recipe_name="tensorwise")
    assert default is not None
    plan = apply_quantization(model, default, device=torch.device("cpu"), fsdp=False, fsdp_backend=None)
    assert plan.notes == [] and plan.after_optimizer_step is None


@pytest.mark.slow
def test_emulated_recipes_train_close_to_bf16(tiny_config: Path, tmp_path: Path) -> None:
    """3 steps of the tiny Qwen3 in bf16 compute, plain and through each recipe.

    Tolerance 2e-3 relative on the loss: float8 e4m3 keeps 3 mantissa bits (up to 6% per
    element), but every matmul output sums 64-128 products with independent rounding and the
    loss averages 256 tokens, so the recipes move the loss by ~3e-4 here.
    """
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    losses: dict[str, list[float]] = {}
    for recipe in ("none", "tensorwise", "rowwise", "mxfp8"):
        extra = [] if recipe == "none" else [f"model.quant_recipe_name={recipe}"]
        out = tmp_path / recipe
        cfg = load_config(
            str(tiny_config),
            [
                "training.steps=3",
                "checkpoint.enable_save=false",
                "model.compute_dtype=bfloat16",
                f"training.output_dir={out}",
                *extra,
            ],
        )
        logs: list[str] = []
        trainer = Trainer(cfg, log=logs.append)
        trainer.setup()
        if recipe != "none":
            assert any(f"quant_recipe_name={recipe}: 14 linear layers" in line for line in logs)
            assert type(trainer.model.model.layers[0].mlp.down_proj) is not nn.Linear
            assert type(trainer.model.lm_head) is nn.Linear
        trainer.train()
        losses[recipe] = [
            json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
        ]
    ref = losses["none"]
    for recipe, values in losses.items():
        assert values == pytest.approx(ref, rel=2e-3), recipe
        assert values[-1] < values[0], recipe  # it trains


def test_bad_keys_fail_at_load_time() -> None:
    with pytest.raises(
        ConfigError, match=r"model\.quant_converters: \['quantize\.linear\.mx'\] does not fit"
    ):
        config_from_dict(
            {
                **BASE,
                "model": {
                    "model_type": "qwen3",
                    "quant_recipe_name": "rowwise",
                    "quant_converters": ["quantize.linear.mx"],
                },
            }
        )
