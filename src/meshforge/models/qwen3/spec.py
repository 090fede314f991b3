"""The Qwen3 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called. Parameter names are the HF safetensors keys (the identity adapter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.common.family_parts import decoder_cp_modules, decoder_stage
from meshforge.models.qwen3.args import OPTION_KEYS, Qwen3Args, from_options
from meshforge.models.spec import FamilyArgs, FamilySpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.qwen3.model import build_qwen3

    assert isinstance(args, Qwen3Args)
    return build_qwen3(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.qwen3.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


FAMILY = FamilySpec(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    model_ids=("qwen3",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    tp_plan=_tp_plan,
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
)
