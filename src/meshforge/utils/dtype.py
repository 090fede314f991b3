"""Config dtype names -> torch dtypes, shared by the trainer, conversion and the CLI."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(value: str | None, *, key: str, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a dtype name to a torch dtype; `None` gives `default`.

    Raises:
        ValueError: naming `key` and the valid spellings, for an unknown name.
    """
    if value is None:
        return default
    try:
        return _DTYPES[value.lower()]
    except KeyError:
        raise ValueError(f"{key}: unknown dtype {value!r}; valid: {', '.join(_DTYPES)}") from None
