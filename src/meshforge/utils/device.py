"""Pick the compute device and its collective backend in one place (no `.cuda()` elsewhere).

`context.device_target` accepts MindFormers' spellings (GPU, Ascend) and ours (cuda, npu, cpu, auto).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

import torch

_ALIASES = {"gpu": "cuda", "cuda": "cuda", "ascend": "npu", "npu": "npu", "cpu": "cpu", "auto": "auto"}
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


# The variables that configure PyTorch's caching allocator (the second is its older name).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn on the CUDA caching allocator's expandable segments unless the allocator is configured.

    Why: without them each large request maps a segment of its own size, and a freed segment
    serves only requests that fit it; a training step's tensors change size (activations,
    logits, gathered weights), so the allocator keeps mapping new segments beside cached ones and
    a run can fail to allocate with much of the device free. With them each pool is one range
    that grows in pages, and the reserved bytes stay close to the live ones (torchtitan launches
    with them too; `train/allocator_replay.py` measures the rest). It must be set before CUDA
    first initialises in the process. Returns whether it was set here.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOC_CONF_VARS):
        return False
    env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return True


def resolve_device(device_target: str, *, local_rank: int = 0) -> torch.device:
    """Map `context.device_target` to a torch device for this process.

    Raises:
        RuntimeError: when the requested accelerator is not available, instead of silently
            training on the CPU.
    """
    kind = _ALIASES.get(str(device_target).lower())
    if kind is None:
        raise ValueError(
            f"context.device_target: unknown device {device_target!r}; valid: auto, cpu, cuda, GPU, npu, Ascend"
        )
    if kind in ("auto", "cuda"):
        prefer_expandable_segments()
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else ("npu" if _npu_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"context.device_target: {device_target!r} requested but CUDA is not available"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "npu":
        if not _npu_available():
            raise RuntimeError(
                f"context.device_target: {device_target!r} requested but torch_npu is not available"
            )
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """Collective backend for a device type: gloo on CPU, nccl on CUDA, hccl on Ascend."""
    return _BACKENDS[device.type]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the accelerator's allocator peak, or the CPU max RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kb) * 1024


def cpu_threads() -> int:
    """Threads torch uses on the CPU (honours OMP_NUM_THREADS, as torch does)."""
    return int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
