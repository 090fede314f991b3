"""Quantised published checkpoints, dequantised at load one tensor at a time.

Two formats of published releases are read, as their ``config.json`` ``quantization_config``
names them:

* ``quant_method: fp8`` (DeepSeek-V3/R1): a weight ``W`` ``[rows, cols]`` is stored as
  ``float8_e4m3fn`` with ``W_scale_inv`` ``float32 [ceil(rows/b0), ceil(cols/b1)]`` beside it,
  ``weight_block_size: [b0, b1]`` (128 x 128); the weight is ``fp8 * scale_inv`` per block.
  Tensors without a ``_scale_inv`` companion (embedding, head, norms, router) are stored as
  they are.
* ``quant_method: mxfp4`` (OpenAI gpt-oss): an expert tensor ``P`` is stored as ``P_blocks``
  ``uint8 [E, rows, groups, 16]`` (two FP4 e2m1 codes per byte, the low nibble first) and
  ``P_scales`` ``uint8 [E, rows, groups]`` (a shared power of two, biased by 127, per 32
  values); the decoded ``[E, rows, groups * 32]`` is transposed to the ``[E, cols, rows]``
  layout of the unquantised tensor (transformers' ``convert_moe_packed_tensors``).

:func:`quantized_view` maps the stored keys to the logical (unquantised) keys the family
adapters ask for, so the loader (``checkpoint/hf.py``) sees an ordinary folder; each logical
tensor is decoded in float32 when read and the loader casts it to the parameter's dtype and
keeps the rank's shard. Other formats are refused by name with the handled ones listed.

Importing this module does not import torch (``config validate`` reads ``config.json`` through it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HANDLED = "fp8 (block-wise, weight_scale_inv, fmt e4m3), mxfp4 (*_blocks / *_scales)"

# OCP MX e2m1 code -> value: bit 3 is the sign, bits 0-2 index the magnitudes.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

FP8_SUFFIX = "_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")


def quantization_method(config: Mapping[str, object]) -> str | None:
    """The handled ``quant_method`` of a ``config.json`` (None when it is not quantised).

    Raises:
        ValueError: For a format not handled, naming it and what is handled.
    """
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"config.json quantization_config: must be a mapping, got {quant!r}")
    method = quant.get("quant_method")
    if method == "fp8":
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"config.json quantization_config.fmt: not supported yet: {fmt!r} (handled: {HANDLED})"
            )
        _block_size(quant)
        return "fp8"
    if method == "mxfp4":
        return "mxfp4"
    raise ValueError(
        f"config.json quantization_config.quant_method: not supported yet: {method!r} (handled: {HANDLED})"
    )


def _block_size(quant: Mapping[str, object]) -> tuple[int, int]:
    block = quant.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"config.json quantization_config.weight_block_size: must be two positive integers, got {block!r}"
        )
    return int(block[0]), int(block[1])


@dataclass
class QuantizedView:
    """The logical keys of a quantised folder, and how to read each one.

    Attributes:
        method: ``fp8``, ``mxfp4``, or None for an unquantised folder (every key as stored).
        key_files: Logical key -> the file of its (main) stored tensor; for the loader.
        parts: Logical key of a quantised tensor -> its stored keys (weight and scales).
        block: The FP8 block size.
    """

    method: str | None
    key_files: dict[str, Path]
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)
    block: tuple[int, int] = (128, 128)

    def covers(self, key: str) -> bool:
        """Whether ``key`` is stored quantised (and so is read through :meth:`read`)."""
        return key in self.parts

    def read(self, key: str, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The tensor of ``key`` (dequantised in float32 if stored quantised); ``tensor(k)`` reads stored ``k``."""
        if key not in self.parts:
            return tensor(key)
        first, second = self.parts[key]
        if self.method == "fp8":
            return dequantize_fp8(tensor(first), tensor(second), self.block)
        return dequantize_mxfp4(tensor(first), tensor(second))


def quantized_view(config: Mapping[str, object], stored: Mapping[str, Path]) -> QuantizedView:
    """The logical view of a folder's stored keys (the keys themselves without quantisation).

    Raises:
        ValueError: For an unhandled format (see :func:`quantization_method`), or an FP8 scale
            (an MXFP4 half) without its weight (other half), naming the key.
    """
    method = quantization_method(config)
    if method is None:
        return QuantizedView(None, dict(stored))
    key_files: dict[str, Path] = {}
    parts: dict[str, tuple[str, str]] = {}
    if method == "fp8":
        for key, file in stored.items():
            if key.endswith(FP8_SUFFIX):
                weight = key[: -len(FP8_SUFFIX)]
                if weight not in stored:
                    raise ValueError(f"{file}: {key} has no weight {weight!r} beside it")
                parts[weight] = (weight, key)
            else:
                key_files[key] = file
        quant = config["quantization_config"]
        assert isinstance(quant, Mapping)  # quantization_method checked it
        return QuantizedView(method, key_files, parts, _block_size(quant))
    blocks, scales = MXFP4_SUFFIXES
    for key, file in stored.items():
        if key.endswith(blocks):
            name = key[: -len(blocks)]
            if name + scales not in stored:
                raise ValueError(f"{file}: {key} has no {name + scales!r} beside it")
            parts[name] = (key, name + scales)
            key_files[name] = file
        elif key.endswith(scales) and key[: -len(scales)] + blocks in stored:
            continue
        else:
            key_files[key] = file
    return QuantizedView(method, key_files, parts)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight * scale_inv`` per ``block`` (the last block of a dim may be partial), in float32.

    Raises:
        ValueError: When the scale grid does not match ``ceil(shape / block)``.
    """
    import torch

    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid:
        raise ValueError(
            f"weight_scale_inv: shape {tuple(scale_inv.shape)} does not fit a weight {tuple(weight.shape)} "
            f"in {block[0]}x{block[1]} blocks (expected {grid})"
        )
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4 ``blocks`` ``[..., rows, G, 16]`` with ``scales`` ``[..., rows, G]``; float32.

    Returns the ``[..., G * 32, rows]`` tensor (the last two dims transposed), the layout
    of gpt-oss' unquantised expert weights.

    Raises:
        ValueError: When the scales do not match the blocks.
    """
    import torch

    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"mxfp4: *_scales shape {tuple(scales.shape)} does not match *_blocks {tuple(blocks.shape)} "
            "(one scale per 16 bytes)"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    low = lut[(codes & 0x0F).long()]
    high = lut[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., rows, G, 32], low nibble first
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).transpose(-1, -2).contiguous()


__all__ = [
    "FP4_VALUES",
    "HANDLED",
    "QuantizedView",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "quantization_method",
    "quantized_view",
]
