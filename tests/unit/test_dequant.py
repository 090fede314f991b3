"""Quantised published checkpoints load dequantised: DeepSeek-V3's block-wise FP8 and gpt-oss'
MXFP4 experts, written here by quantisers built from the format definitions, load to the
decoded values exactly and to within the format's rounding of the unquantised weights; an
unhandled format and a missing shard are named before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshforge.checkpoint.hf import find_hf_weights, load_hf_weights, save_hf
from meshforge.models.common.dequant import FP4_VALUES, quantization_method
from meshforge.models.registry import resolve_family

E4M3_MAX = 448.0


# ------------------------------------------------------------------------------ the formats
def quantise_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block-wise FP8: per block, scale = amax / 448, stored fp8 = w / scale (e4m3,
    round to nearest), ``weight_scale_inv`` = scale (what dequantisation multiplies by)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            amax = float(part.abs().max())
            s = amax / E4M3_MAX if amax > 0 else 1.0
            scale[i, j] = s
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (part / s).to(
                torch.float8_e4m3fn
            )
    return q, scale


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
    return out


def quantise_mxfp4(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 as gpt-oss stores its experts: ``tensor`` ``[E, cols, rows]`` is transposed to
    ``[E, rows, cols]``, each run of 32 values along ``cols`` shares the exponent
    ``floor(log2(amax)) - 2`` (e2m1's largest exponent), each value is rounded to the nearest e2m1
    value (clamped to +-6) and coded sign << 3 | magnitude index; two codes per byte, low nibble first."""
    x = tensor.transpose(-1, -2).float()
    *lead, cols = x.shape
    groups = x.reshape(*lead, cols // 32, 32)
    amax = groups.abs().amax(-1)
    exp = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.full_like(amax, -127)
    )
    exp = exp.clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    *lead, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * 32)
    flat_blocks, flat_out, flat_scales = (
        blocks.reshape(-1, groups, 16),
        out.reshape(-1, groups * 32),
        scales.reshape(-1, groups),
    )
    for r in range(flat_blocks.shape[0]):
        for g in range(groups):
            for b in range(16):
                byte = int(flat_blocks[r, g, b])
                power = 2.0 ** (int(flat_scales[r, g]) - 127)
                flat_out[r, g * 32 + 2 * b] = FP4_VALUES[byte & 0x0F] * power
                flat_out[r, g * 32 + 2 * b + 1] = FP4_VALUES[byte >> 4] * power
    return out.transpose(-1, -2)


# ------------------------------------------------------------------------------ folders
def _fp8_quantised(key: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and key.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_fp8_folder(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Quantise an unquantised HF folder's projection weights; returns the decoded tensors."""
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    decoded: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in _read(src).items():
        if _fp8_quantised(key, tensor):
            q, scale = quantise_fp8(tensor, block)
            out[key], out[key + "_scale_inv"] = q, scale
            decoded[key] = decode_fp8(q, scale, block)
        else:
            out[key] = tensor
    _write(dst, config, out)
    return decoded


def write_mxfp4_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "modules_to_not_convert": ["model.layers.*.self_attn"],
        "quant_method": "mxfp4",
    }
    decoded: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in _read(src).items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantise_mxfp4(tensor)
            out[key + "_blocks"], out[key + "_scales"] = blocks, scales
            decoded[key] = decode_mxfp4(blocks, scales)
        else:
            out[key] = tensor
    _write(dst, config, out)
    return decoded


def _read(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _write(dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards with an index, as published folders are."""
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: tensors[k].contiguous() for k in part}, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


DEEPSEEK = {
    "flavor": "debug",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "q_lora_rank": 24,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}
GPT_OSS = {"flavor": "debug", "vocab_size": 96}


def build(family_name: str, options: dict, *, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    family = resolve_family(family_name, None, None)
    model = family.build(options, device="meta")
    model.to_empty(device=device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def unquantised_folder(family_name: str, options: dict, path: Path) -> torch.nn.Module:
    model = build(family_name, options)
    save_hf(model, resolve_family(family_name, None, None), path)
    return model


@pytest.mark.parametrize("block", [(128, 128), (8, 16)])
def test_fp8_folder_loads_dequantised(tmp_path: Path, block: tuple[int, int]) -> None:
    family = resolve_family("deepseek_v3", None, None)
    original = unquantised_folder("deepseek_v3", DEEPSEEK, tmp_path / "plain")
    decoded = write_fp8_folder(tmp_path / "plain", tmp_path / "fp8", block)
    assert any(k.endswith("_scale_inv") for k in find_hf_weights(tmp_path / "fp8"))
    model = build("deepseek_v3", DEEPSEEK, seed=1)
    assert load_hf_weights(model, family, tmp_path / "fp8") == len(list(model.parameters()))
    mine = dict(model.named_parameters())
    checked = 0
    for name, param in original.named_parameters():
        got = mine[name].detach()
        # A fused expert tensor stacks per-expert keys: compare the decoded keys one by one.
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".", 1)[0]
            e = 0
            while f"{prefix}.{e}.down_proj.weight" in decoded:
                if name.endswith("gate_up_proj"):
                    want = torch.cat(
                        [decoded[f"{prefix}.{e}.gate_proj.weight"], decoded[f"{prefix}.{e}.up_proj.weight"]]
                    )
                else:
                    want = decoded[f"{prefix}.{e}.down_proj.weight"]
                assert torch.equal(got[e], want), (name, e)
                e += 1
            assert e == got.shape[0]
            checked += 1
        elif name in decoded:
            assert torch.equal(got, decoded[name]), name
            checked += 1
        else:
            assert torch.equal(got, param.detach()), name  # stored unquantised
            continue
        # Within e4m3's rounding (3 mantissa bits: half a step is 2^-4 of the value; subnormals
        # below 2^-6 have steps of 2^-9) of the unquantised weight, scaled per block.
        w = param.detach()
        err = (got - w).abs()
        scale = w.abs().amax() / E4M3_MAX
        assert bool((err <= w.abs() * 2**-4 + scale * 2**-9 + 1e-12).all()), name
        assert 0 < float(err.max())  # it was quantised
    assert checked >= 10


def test_mxfp4_folder_loads_dequantised(tmp_path: Path) -> None:
    family = resolve_family("gpt_oss", None, None)
    original = unquantised_folder("gpt_oss", GPT_OSS, tmp_path / "plain")
    decoded = write_mxfp4_folder(tmp_path / "plain", tmp_path / "mxfp4")
    keys = find_hf_weights(tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    model = build("gpt_oss", GPT_OSS, seed=1)
    load_hf_weights(model, family, tmp_path / "mxfp4")
    mine = dict(model.named_parameters())
    for name, param in original.named_parameters():
        got, w = mine[name].detach(), param.detach()
        if name not in decoded:
            assert torch.equal(got, w), name
            continue
        assert torch.equal(got, decoded[name]), name
        # Within MXFP4's rounding: per 32 values the grid step is at most 2 * 2^exp (between 4
        # and 6, or the clamp at 6 of values up to 8 * 2^exp), 2^exp = 2^floor(log2 amax) / 4.
        groups = w.transpose(-1, -2).reshape(*w.shape[:-2], w.shape[-1], -1, 32)
        step = 2.0 ** torch.floor(torch.log2(groups.abs().amax(-1))) / 4
        err = (got - w).abs().transpose(-1, -2).reshape(groups.shape)
        assert bool((err <= 2 * step.unsqueeze(-1)).all()), name
        assert float((got - w).norm() / w.norm()) < 0.2


def test_bf16_model_takes_the_dequantised_values_rounded_once(tmp_path: Path) -> None:
    family = resolve_family("deepseek_v3", None, None)
    unquantised_folder("deepseek_v3", DEEPSEEK, tmp_path / "plain")
    decoded = write_fp8_folder(tmp_path / "plain", tmp_path / "fp8", (128, 128))
    model = build("deepseek_v3", DEEPSEEK).to(torch.bfloat16)
    load_hf_weights(model, family, tmp_path / "fp8")
    key = "model.layers.0.self_attn.q_a_proj.weight"
    assert torch.equal(model.get_parameter(key).detach(), decoded[key].to(torch.bfloat16))


def test_unhandled_format_and_missing_shard_are_named(tmp_path: Path) -> None:
    assert (
        quantization_method({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
        == "fp8"
    )
    assert quantization_method({}) is None
    with pytest.raises(ValueError, match="quant_method: not supported yet: 'gptq' \\(handled: fp8 .*mxfp4"):
        quantization_method({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ValueError, match="fmt: not supported yet: 'e5m2'"):
        quantization_method({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
    from meshforge.models.deepseek_v3.hf import from_hf_config

    with pytest.raises(ValueError, match="'bitsandbytes'"):
        from_hf_config({"quantization_config": {"quant_method": "bitsandbytes"}})

    family = resolve_family("deepseek_v3", None, None)
    unquantised_folder("deepseek_v3", DEEPSEEK, tmp_path / "plain")
    write_fp8_folder(tmp_path / "plain", tmp_path / "fp8", (128, 128))
    (tmp_path / "fp8" / "model-00002-of-00002.safetensors").unlink()
    model = build("deepseek_v3", DEEPSEEK)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FileNotFoundError, match="1 are missing: model-00002-of-00002.safetensors"):
        load_hf_weights(model, family, tmp_path / "fp8")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing read
