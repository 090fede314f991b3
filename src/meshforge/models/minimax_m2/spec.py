"""The MiniMax-M2 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called. MindSpeed names the model ``minimax_m27`` (its ``model_id``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.common.family_parts import (
    aux_reduce,
    decoder_cp_modules,
    decoder_stage,
    grouped_experts,
)
from meshforge.models.minimax_m2.args import OPTION_KEYS, MiniMaxM2Args, from_options
from meshforge.models.spec import FamilyArgs, FamilySpec, MoESpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.spec import HFStateDictAdapter


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.minimax_m2.model import build_minimax_m2

    assert isinstance(args, MiniMaxM2Args)
    return build_minimax_m2(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.minimax_m2.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _hf_adapter(spec: FamilySpec, args: FamilyArgs | None) -> HFStateDictAdapter:
    from meshforge.models.minimax_m2.hf import state_dict_adapter

    assert args is None or isinstance(args, MiniMaxM2Args)
    return state_dict_adapter(spec, args)


FAMILY = FamilySpec(
    name="minimax_m2",
    hf_architectures=("MiniMaxM2ForCausalLM",),
    model_ids=("minimax_m27", "minimax_m2"),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    adapter=_hf_adapter,
    tp_plan=_tp_plan,
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    moe=MoESpec(
        expert_type=grouped_experts, expert_count_key="model.num_local_experts", aux_reduce=aux_reduce
    ),
)
