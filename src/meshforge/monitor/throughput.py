"""Model FLOPs throughput and utilisation (`training.log_throughput`).

Tokens per second alone does not compare models or machines; model FLOPs per second does, and
against the device's dense peak it gives the MFU that torchtitan and Megatron report. The FLOPs of
a token are the model's own count (`flops_per_token(seq_len)`: 6 x the parameters a token
multiplies with, plus attention, for the built-in families), else 6 x all parameters (the
generic path: attention left out, an underestimate at long sequences).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

# Dense peak TFLOP/s per accelerator for 16-bit (bf16/fp16) matmuls; fp32 runs use the TF32
# peak's half. Substring of `torch.cuda.get_device_name()` -> peak. Unknown devices (and the CPU)
# give no MFU, only TFLOP/s.
_PEAK_TFLOPS_16BIT = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 125.0),
)


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one token at sequence length `seq_len`."""
    count = getattr(model, "flops_per_token", None)
    if callable(count):
        return float(count(seq_len))
    return 6.0 * float(sum(p.numel() for p in model.parameters()))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense matmul peak in FLOP/s for `dtype`, or None when unknown (CPU included)."""
    import torch

    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_TFLOPS_16BIT:
        if key in name:
            scale = 1.0 if dtype in (torch.bfloat16, torch.float16) else 0.5
            return tflops * scale * 1e12
    return None


def throughput_fields(
    tokens_per_s: float, *, flops_per_token: float, world_size: int, peak: float | None
) -> dict[str, float]:
    """The step record's throughput keys: job and per-rank TFLOP/s, and MFU when the peak is known."""
    flops = flops_per_token * tokens_per_s
    fields = {"tflops": flops / 1e12, "tflops_per_rank": flops / world_size / 1e12}
    if peak:
        fields["mfu"] = flops / world_size / peak
    return fields
