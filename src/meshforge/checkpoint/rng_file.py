"""One rank's RNG states on disk (`rng/rank_XXXXX.pt`), in a form that loads without running code.

The file is a `torch.save` of a dict holding only text and tensors, read back with
`torch.load(weights_only=True)`: `json`, one JSON object with Python's `random` state (its
version, 625 32-bit words and the cached gaussian) and numpy's legacy MT19937 scalars (position,
cached gaussian); `numpy_keys`, numpy's 624 key words as an int64 tensor; `torch_cpu` and
`torch_cuda`, torch's generator states, the uint8 tensors torch hands out. JSON writes a float
as the shortest text that reads back to the same bits, so every state restores exactly.

Older meshforge checkpoints pickled the `RNGState` dict itself, numpy's key words as an ndarray.
Those are read by the same `weights_only=True` load with exactly the numpy globals an ndarray
is rebuilt from allowed (`_LEGACY_GLOBALS`), so they still resume bitwise. In both formats every
value is checked against the shape `utils/seed.py` gives it before anything is restored; any
other global is refused in one line (`dcp_reader.refusal`).
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from meshforge.checkpoint.dcp_reader import first_global, refusal
from meshforge.utils.seed import RNGState

FORMAT = "meshforge-rng/2"
_MT_WORDS = 624


# The globals a pickled numpy array refers to: its class, its dtype's, and the function that
# rebuilds it (named `numpy._core.multiarray._reconstruct` by numpy 2 and
# `numpy.core.multiarray._reconstruct` by numpy 1, which older checkpoints were written with).
def _array_rebuilder() -> Callable[..., object]:
    reduced = np.empty(0).__reduce__()
    assert isinstance(reduced, tuple) and callable(reduced[0])
    return reduced[0]


_LEGACY_GLOBALS: list[Callable[..., object] | tuple[Callable[..., object], str]] = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    _array_rebuilder(),
    (_array_rebuilder(), "numpy.core.multiarray._reconstruct"),
]


def write_rng_file(file: Path, state: RNGState) -> None:
    """Write `state` (as `utils.seed.rng_state` captures it) in the format above."""
    version, words, gauss = state["python"]
    if not isinstance(words, tuple):
        raise TypeError("the Python random state must be random.getstate()'s tuple")
    algorithm, keys, pos, has_gauss, cached = _numpy_tuple(state)
    text = {
        "python": {"version": version, "state": list(words), "gauss_next": gauss},
        "numpy": {"algorithm": algorithm, "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
    }
    payload: dict[str, object] = {
        "format": FORMAT,
        "json": json.dumps(text),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "torch_cpu": state["torch_cpu"],
    }
    if "torch_cuda" in state:
        payload["torch_cuda"] = list(state["torch_cuda"])
    torch.save(payload, file)


def _numpy_tuple(state: RNGState) -> tuple[str, np.ndarray, int, int, float]:
    numpy_state = state["numpy"]
    if not isinstance(numpy_state, tuple):
        raise TypeError("the numpy RNG state must be np.random.get_state()'s legacy tuple")
    algorithm, keys, pos, has_gauss, cached = numpy_state
    return algorithm, keys, int(pos), int(has_gauss), float(cached)


def read_rng_file(file: Path) -> RNGState | None:
    """One rank's saved RNG states, or None when that rank saved none (another world size).

    Raises:
        ValueError: naming the file: a global that is not plain data (a file that would run code),
            a damaged file, or contents that are not RNG states.
    """
    if not file.is_file():
        return None
    if not zipfile.is_zipfile(file):
        # meshforge has always written torch.save's zip format: a bare pickle is someone else's.
        named = first_global(file)
        if named is not None:
            raise ValueError(refusal(file, named))
    try:
        with torch.serialization.safe_globals(_LEGACY_GLOBALS):
            loaded = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise ValueError(
            refusal(file, found.group(1) if found else "a global that is not plain data")
        ) from None
    except Exception as err:  # noqa: BLE001 - a damaged zip can raise almost anything
        raise ValueError(
            f"{file}: the saved RNG state cannot be read ({type(err).__name__}: {err}); the "
            "checkpoint is damaged: load another step folder"
        ) from None
    try:
        if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
            return _checked(_decoded(loaded))
        if isinstance(loaded, dict) and "format" not in loaded:
            return _checked(loaded)
        raise ValueError(f"it holds a {type(loaded).__name__} of another format")
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(
            f"{file}: not the RNG state of a meshforge checkpoint ({err}); delete the rng folder to "
            "resume with fresh RNG states (the run then differs from one that was not interrupted)"
        ) from None


def _decoded(payload: dict[str, object]) -> dict[str, object]:
    """The current format's payload as the `RNGState` layout (checked by `_checked`)."""
    text = payload["json"]
    if not isinstance(text, str):
        raise TypeError("`json` is not text")
    scalars = json.loads(text)
    python, numpy_scalars = scalars["python"], scalars["numpy"]
    keys = payload["numpy_keys"]
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64:
        raise TypeError("`numpy_keys` is not an int64 tensor")
    if keys.shape != (_MT_WORDS,):
        raise ValueError(f"`numpy_keys` has shape {list(keys.shape)}, not [{_MT_WORDS}]")
    if keys.min() < 0 or keys.max() >= 2**32:
        raise ValueError("`numpy_keys` holds words outside 32 bits")
    state: dict[str, object] = {
        "python": (python["version"], tuple(python["state"]), python["gauss_next"]),
        "numpy": (
            numpy_scalars["algorithm"],
            keys.numpy().astype(np.uint32),
            numpy_scalars["pos"],
            numpy_scalars["has_gauss"],
            numpy_scalars["cached_gaussian"],
        ),
        "torch_cpu": payload["torch_cpu"],
    }
    if "torch_cuda" in payload:
        state["torch_cuda"] = payload["torch_cuda"]
    return state


def _checked(state: dict[str, object]) -> RNGState:
    """`state` as an `RNGState`, after checking every value has the type and size it must have."""
    python = state["python"]
    if not (
        isinstance(python, tuple)
        and len(python) == 3
        and _is_int(python[0])
        and isinstance(python[1], tuple)
        and len(python[1]) == _MT_WORDS + 1
        and all(_is_int(word) for word in python[1])
        and (python[2] is None or isinstance(python[2], float))
    ):
        raise ValueError("the Python random state is not (version, 625 words, gaussian)")
    numpy_state = state["numpy"]
    if not (
        isinstance(numpy_state, tuple)
        and len(numpy_state) == 5
        and numpy_state[0] == "MT19937"
        and isinstance(numpy_state[1], np.ndarray)
        and numpy_state[1].dtype == np.uint32
        and numpy_state[1].shape == (_MT_WORDS,)
        and _is_int(numpy_state[2])
        and _is_int(numpy_state[3])
        and isinstance(numpy_state[4], float)
    ):
        raise ValueError("the numpy state is not MT19937's (name, 624 words, pos, has_gauss, gaussian)")
    result: RNGState = {
        "python": python,
        "numpy": (numpy_state[0], numpy_state[1], numpy_state[2], numpy_state[3], numpy_state[4]),
        "torch_cpu": _byte_tensor(state["torch_cpu"], "torch_cpu"),
    }
    if "torch_cuda" in state:
        cuda = state["torch_cuda"]
        if not isinstance(cuda, list):
            raise TypeError("`torch_cuda` is not a list of generator states")
        result["torch_cuda"] = [_byte_tensor(item, "torch_cuda") for item in cuda]
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _byte_tensor(value: object, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError(f"`{key}` is not a generator state (a 1-D uint8 tensor)")
    return value
