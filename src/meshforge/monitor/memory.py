"""Memory figures for every `metrics.jsonl` record (rank 0's process).

- `memory_bytes` (always): the peak, as before (accelerator allocator peak, or the CPU max RSS).
- On an accelerator (CUDA, NPU): `device_memory_allocated_bytes`, `device_memory_reserved_bytes`,
  `device_memory_peak_bytes` from the caching allocator (counters, no synchronisation).
- With `training.log_cpu_memory`: `cpu_memory_bytes` (the resident set now) and
  `cpu_memory_peak_bytes` (its maximum so far).
"""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from meshforge.utils.device import peak_memory_bytes


def _rss_bytes() -> int:
    """The resident set size now (Linux `/proc/self/statm`); the peak where that is unavailable."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _accelerator(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return getattr(torch, "npu", None)
    return None


def memory_fields(device: torch.device, *, host: bool) -> dict[str, int]:
    """The memory keys of one step's record."""
    fields = {"memory_bytes": peak_memory_bytes(device)}
    api = _accelerator(device)
    if api is not None:
        fields["device_memory_allocated_bytes"] = int(api.memory_allocated(device))
        fields["device_memory_reserved_bytes"] = int(api.memory_reserved(device))
        fields["device_memory_peak_bytes"] = int(api.max_memory_allocated(device))
    if host:
        now = _rss_bytes()
        fields["cpu_memory_bytes"] = now
        # The kernel's high-water mark is updated lazily: it can trail the current figure.
        fields["cpu_memory_peak_bytes"] = max(now, _peak_rss_bytes())
    return fields
