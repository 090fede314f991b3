"""`context:` section: execution mode and device selection (light).

meshforge always runs eagerly, so `mode` accepts only 1 (MindSpore's PyNative = eager). The device
defaults to `auto` (CUDA if available, then NPU, then CPU); Ascend/GPU spellings are accepted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from meshforge.config.base import StrictSection, describe

DEVICE_ALIASES = {"auto": "auto", "cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "npu": "npu", "ascend": "npu"}


class ContextConfig(StrictSection):
    """Execution context."""

    mode: Literal[1] = describe(1, "Execution mode; only 1 (eager, MindSpore PyNative) exists.")
    max_device_memory: str = describe(
        "59GB", "Ascend device-memory cap (e.g. '59GB'); no effect on other devices."
    )
    device_target: str = describe("auto", "Device: auto, cpu, cuda (alias GPU) or npu (alias Ascend).")

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: object) -> object:
        if isinstance(value, bool) or value not in (1, "1"):
            raise ValueError(f"only 1 (eager/PyNative) is supported, got {value!r}")
        return 1

    @field_validator("device_target")
    @classmethod
    def _device(cls, value: str) -> str:
        if value.strip().lower() not in DEVICE_ALIASES:
            raise ValueError(f"must be one of auto, cpu, cuda, GPU, npu, Ascend; got {value!r}")
        return value

    @field_validator("max_device_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        text = value.strip().upper()
        if not text.endswith("GB") or not text[:-2].replace(".", "", 1).isdigit():
            raise ValueError(f"must look like '59GB', got {value!r}")
        return value

    def device(self) -> str:
        """The canonical device name: auto, cpu, cuda or npu."""
        return DEVICE_ALIASES[self.device_target.strip().lower()]
