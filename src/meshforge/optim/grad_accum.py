"""The dtype gradients add up in over a step's micro-batches: `optimizer.accumulate_allreduce_grads_in_fp32`.

Megatron and MindFormers keep a low-precision model's gradients in an fp32 buffer while the
micro-batches of a step add up, and reduce them across ranks in fp32 (`true`, the default);
`false` keeps both in the low-precision dtype (half the bytes, about 3 significant digits).
Which dtype is "low" depends on where the model is low-precision:

* Parameters stored in bf16/fp16 (`model.params_dtype`): autograd adds each micro-batch's
  gradient into `.grad` in that dtype. With `true`, every micro-batch's gradient moves into an
  fp32 buffer of its own (`after_micro_batch`) and `.grad` gets the fp32 sum once, rounded
  to the parameter dtype, at the end (`finish`): one rounding per step instead of one per
  micro-batch (under FSDP2, plus the rounding of each micro-batch's reduced shard, which FSDP
  casts back to the parameter dtype). The optimizer sees a gradient of the parameter's dtype (torch keeps `.grad`
  in the parameter's dtype); what changes is how it was summed. `false` is autograd's own
  accumulation.
* fp32 parameters computed in bf16/fp16 (`model.compute_dtype`: autocast in one process,
  FSDP2's `MixedPrecisionPolicy.param_dtype` under FSDP): the gradients reach the fp32
  parameters (and FSDP's sharded `.grad`) in fp32. `true` is that. With `false` the sum is
  rounded to the compute dtype after every micro-batch, as a buffer of that dtype would hold it.
* Everything fp32: nothing to do for either value.

The reduction across data-parallel ranks follows the same flag: `reduce_dtype_for` gives
FSDP2's `MixedPrecisionPolicy.reduce_dtype` (fp32, or the low-precision dtype with `false`).
Under pipeline parallelism the schedule accumulates unsharded gradients inside FSDP (in the
reduce dtype) and this class is not used.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

__all__ = ["GradAccumulation", "low_precision_dtype", "reduce_dtype_for"]

_LOW = (torch.bfloat16, torch.float16)


def low_precision_dtype(params_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The low-precision dtype of a run (stored parameters first, then the compute), or None."""
    if params_dtype in _LOW:
        return params_dtype
    if compute_dtype in _LOW:
        return compute_dtype
    return None


def reduce_dtype_for(
    configured: torch.dtype, *, fp32: bool, params_dtype: torch.dtype, compute_dtype: torch.dtype
) -> torch.dtype:
    """FSDP2's reduce dtype: `parallelism.reduce_dtype` (`configured`), or the low-precision dtype
    when `accumulate_allreduce_grads_in_fp32` is false and the run has one."""
    low = low_precision_dtype(params_dtype, compute_dtype)
    if fp32 or low is None:
        return configured
    return low


class GradAccumulation:
    """Sums a step's micro-batch gradients in the dtype the flag asks for (see the module docstring).

    Call `after_micro_batch()` after each micro-batch's backward and `finish()` once after the
    last one, before clipping and the optimizer step. Both are no-ops where autograd's own
    accumulation already is what the flag asks for (`active` is False).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        fp32: bool,
        params_dtype: torch.dtype,
        compute_dtype: torch.dtype,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.low = low_precision_dtype(params_dtype, compute_dtype)
        stored_low = params_dtype in _LOW
        # "buffer": fp32 sums for low-precision parameters; "round": low-precision sums for fp32
        # parameters computed in low precision; None: autograd's accumulation is already right.
        self.mode: str | None = None
        if self.low is not None and fp32 and stored_low:
            self.mode = "buffer"
        elif self.low is not None and not fp32 and not stored_low:
            self.mode = "round"
        self._sums: dict[int, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.mode is not None

    def describe(self) -> str:
        if self.mode == "buffer":
            return f"gradients of {self.low} parameters accumulate in float32 buffers"
        if self.mode == "round":
            return f"gradients accumulate in {self.low} (optimizer.accumulate_allreduce_grads_in_fp32: false)"
        return ""

    def after_micro_batch(self) -> None:
        if self.mode == "buffer":
            for p in self.params:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                held = self._sums.get(id(p))
                self._sums[id(p)] = grad if held is None else held.add_(grad)
                p.grad = None
        elif self.mode == "round":
            assert self.low is not None
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.copy_(p.grad.to(self.low))

    def finish(self) -> None:
        if self.mode != "buffer":
            return
        for p in self.params:
            held = self._sums.pop(id(p), None)
            if held is not None:
                p.grad = held.to(p.dtype)
        self._sums.clear()

    def buffers(self) -> list[torch.Tensor]:
        """The fp32 sums held so far (for tests and memory accounting)."""
        return list(self._sums.values())
