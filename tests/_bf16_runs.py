"""Tiny trainer runs in bf16 and fp32 for the gradient-accumulation dtype tests (one process or dp2).

`run` builds the real `Trainer` from the shared tiny config with 8 micro-batches per step (so
that the accumulation dtype matters), trains a few steps and returns the losses and the first
step's gradients as the optimizer receives them (dtype and float64 values).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from meshforge.config import load_config
from meshforge.train.trainer import Trainer

# Stored and computed in bf16 ("b") or stored fp32 and computed in bf16 ("m"), each with the
# fp32 (default) and the bf16 accumulation.
VARIANTS: dict[str, list[str]] = {
    "fp32": [],
    "b_fp32acc": ["model.params_dtype=bfloat16", "model.compute_dtype=bfloat16"],
    "b_bf16acc": [
        "model.params_dtype=bfloat16",
        "model.compute_dtype=bfloat16",
        "optimizer.accumulate_allreduce_grads_in_fp32=false",
    ],
    "m_fp32acc": ["model.compute_dtype=bfloat16"],
    "m_bf16acc": ["model.compute_dtype=bfloat16", "optimizer.accumulate_allreduce_grads_in_fp32=false"],
    # Low-precision linear layers (parallel/float8.py) on top of bf16 compute.
    "mxfp8": ["model.compute_dtype=bfloat16", "model.quant_recipe_name=mxfp8"],
}


class _Recording(Trainer):
    def clip_grads(self) -> torch.Tensor:
        if not hasattr(self, "first_grads"):
            # After the last micro-batch (and FSDP's reduce), before clipping and the update.
            self.first_grads = {
                name: (p.grad.dtype, _full(p.grad).double())
                for name, p in self.model.named_parameters()
                if p.grad is not None
            }
        return super().clip_grads()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def run(config: Path, out: Path, name: str, *, global_batch: int = 8, steps: int = 3) -> dict[str, Any]:
    overrides = [
        f"training.steps={steps}",
        "training.local_batch_size=1",
        f"training.global_batch_size={global_batch}",
        "checkpoint.enable_save=false",
        f"training.output_dir={out / name}",
        *VARIANTS[name],
    ]
    logs: list[str] = []
    trainer = _Recording(load_config(str(config), overrides), log=logs.append)
    trainer.setup()
    reduce_dtypes = sorted({str(d) for d in _reduce_dtypes(trainer.model)})
    records: list[dict[str, Any]] = []
    real_log = trainer.log_step
    trainer.log_step = lambda record: (records.append(record), real_log(record))[-1]  # type: ignore[method-assign]
    trainer.train()
    trainer.close()
    return {
        "model": trainer.model,
        "losses": [r["loss"] for r in records],
        "grads": trainer.first_grads,
        "reduce_dtypes": reduce_dtypes,
        "logs": logs,
    }


def _reduce_dtypes(model: torch.nn.Module) -> list[torch.dtype]:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.append(group.mp_policy.reduce_dtype)
    return out


def grad_error(run_: dict[str, Any], reference: dict[str, Any]) -> float:
    """Norm-relative error of a run's first-step gradients against the reference run's."""
    num = sum(float(((run_["grads"][n][1] - g) ** 2).sum()) for n, (_, g) in reference["grads"].items())
    den = sum(float((g**2).sum()) for _, g in reference["grads"].values())
    return (num / den) ** 0.5


def grad_dtypes(run_: dict[str, Any]) -> set[torch.dtype]:
    return {dtype for dtype, _ in run_["grads"].values()}
