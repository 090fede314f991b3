"""The Qwen3-Next family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.common.family_parts import attention_classes, aux_reduce, grouped_experts
from meshforge.models.qwen3_next.args import OPTION_KEYS, Qwen3NextArgs, from_options
from meshforge.models.spec import CPModules, FamilyArgs, FamilySpec, MoESpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import HFStateDictAdapter


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.qwen3_next.model import build_qwen3_next

    assert isinstance(args, Qwen3NextArgs)
    return build_qwen3_next(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.qwen3_next.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _hf_adapter(spec: FamilySpec, args: FamilyArgs | None) -> HFStateDictAdapter:
    from meshforge.models.qwen3_next.hf import state_dict_adapter

    assert args is None or isinstance(args, Qwen3NextArgs)
    return state_dict_adapter(spec, args)


def _stage(b: StageBatch) -> LayerRunner:
    from meshforge.models.qwen3_next.stage import qwen3_next_stage

    return qwen3_next_stage(b)


def _cp_modules() -> CPModules:
    from meshforge.models.qwen3_next.gdn import GatedDeltaNet
    from meshforge.models.qwen3_next.model import Qwen3NextModel

    return CPModules(decoders=(Qwen3NextModel,), attentions=attention_classes(), mixers=(GatedDeltaNet,))


FAMILY = FamilySpec(
    name="qwen3_next",
    hf_architectures=("Qwen3NextForCausalLM",),
    model_ids=("qwen3_next",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    adapter=_hf_adapter,
    tp_plan=_tp_plan,
    stage_preparation=_stage,
    cp_modules=_cp_modules,
    cp_methods=("ulysses",),
    cp_refusal=(
        "its Gated DeltaNet layers run a recurrence (and a causal conv) whose state is carried "
        "token by token along the whole sequence, across the CP ranks' slices, which the "
        "attention-only exchanges (colossal/ring, kvallgather, hybrid) cannot hand over; use "
        "context_parallel_method ulysses (whole rows per head slice, as the reference does)"
    ),
    moe=MoESpec(expert_type=grouped_experts, expert_count_key="model.num_experts", aux_reduce=aux_reduce),
)
