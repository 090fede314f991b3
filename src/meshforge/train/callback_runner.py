"""Runs the `callbacks:` of a run: every hook guarded, requests and failures agreed by all ranks.

A hook that raises does not stop its rank on the spot (the others would wait forever in the next
collective): the failure is kept, and at the next agreement point (`agree`) every rank learns that
a callback failed and raises `CallbackError`, the failing rank (`CallbackHookError`) with the callback's name, the hook,
the exception and where it was raised. `agree` is one all-reduce, and only with callbacks.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

from meshforge.train.callbacks import Callback, CallbackHookError, PeerCallbackError


class CallbackRunner:
    """The run's callbacks on this rank."""

    def __init__(self, callbacks: list[Callback], *, rank: int, device: torch.device) -> None:
        self.callbacks = callbacks
        self.rank = rank
        self.device = device
        self._failure: str | None = None

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        """Run `hook` on every callback in order; after a failure, the rest of the run skips them."""
        if self._failure is not None:
            return
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(*args)
            except Exception as err:  # a user's hook can fail in any way: keep it, named
                frame = traceback.extract_tb(err.__traceback__)[-1]
                self._failure = (
                    f"{callback.config_name or type(callback).__qualname__}: {hook} raised "
                    f"{type(err).__name__}: {err} (at {frame.filename}:{frame.lineno}); the run stopped"
                )
                return

    def agree(self) -> tuple[bool, bool]:
        """(save now, stop) as any rank's callbacks asked; raise if any rank's callback failed."""
        if not self.callbacks:
            return False, False
        save = stop = False
        for callback in self.callbacks:
            s, t = callback.take_requests()
            save, stop = save or s, stop or t
        failed = self.rank + 1 if self._failure is not None else 0
        flags = torch.tensor([float(failed), float(save), float(stop)], dtype=torch.float64).to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_failed, any_save, any_stop = (float(v) for v in flags.cpu())
        if self._failure is not None:
            raise CallbackHookError(self._failure)
        if any_failed:
            raise PeerCallbackError(f"a callback failed on rank {int(any_failed) - 1}; the run stopped")
        return any_save > 0, any_stop > 0
