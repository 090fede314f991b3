"""Seeding, deterministic mode, and capture/restore of every RNG for exact resume."""

from __future__ import annotations

import os
import random
from typing import NotRequired, TypedDict

import numpy as np
import numpy.typing as npt
import torch


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and accelerators) with the same value."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Turn on torch's deterministic algorithms.

    Cost: some CUDA kernels fall back to slower deterministic versions (scatter/index_add,
    cuBLAS needs a fixed workspace), and ops without a deterministic version raise. On the CPU
    the cost is usually negligible.
    """
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


# What np.random.get_state() returns and set_state() takes: the legacy Mersenne Twister tuple.
NumpyState = dict[str, object] | tuple[str, npt.NDArray[np.uint32], int, int, float]


class RNGState(TypedDict):
    """One process's RNG states (`torch_cuda` only once CUDA is initialised).

    On disk as `checkpoint/rng_file.py` writes them: tensors and JSON, no pickled objects.
    """

    python: tuple[object, ...]
    numpy: NumpyState
    torch_cpu: torch.Tensor
    torch_cuda: NotRequired[list[torch.Tensor]]


def rng_state() -> RNGState:
    """Every RNG this process uses (`checkpoint/rng_file.py` writes it as tensors and JSON)."""
    state: RNGState = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: RNGState) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
