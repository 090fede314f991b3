"""The Mamba-3 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called. Context parallelism is refused (``cp_methods`` empty): see ``CP_REFUSAL``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.mamba3.args import OPTION_KEYS, Mamba3Args, from_options
from meshforge.models.spec import FamilyArgs, FamilySpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import HFStateDictAdapter

CP_REFUSAL = (
    "mamba3 is a state-space recurrence: every token's state depends on all earlier tokens of "
    "its document, so a rank holding a later slice of the sequence needs the state at the end of "
    "the slices before it, which no built CP method hands over (attention exchanges keys and "
    "values); set parallelism.context_parallel to 1 (MindSpeed cp_size) for mamba3"
)


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.mamba3.model import build_mamba3

    assert isinstance(args, Mamba3Args)
    return build_mamba3(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.mamba3.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _hf_adapter(spec: FamilySpec, args: FamilyArgs | None) -> HFStateDictAdapter:
    from meshforge.models.mamba3.hf import Mamba3StateDictAdapter

    return Mamba3StateDictAdapter(spec, args)


def _stage(b: StageBatch) -> LayerRunner:
    from meshforge.models.mamba3.stage import mamba3_stage

    return mamba3_stage(b)


FAMILY = FamilySpec(
    name="mamba3",
    hf_architectures=("Mamba3ForCausalLM",),
    model_ids=("mamba3",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    adapter=_hf_adapter,
    tp_plan=_tp_plan,
    stage_preparation=_stage,
    cp_modules=None,
    cp_methods=(),
    cp_refusal=CP_REFUSAL,
)
