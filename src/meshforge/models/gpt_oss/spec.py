"""The gpt-oss family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.common.family_parts import attention_classes, aux_reduce
from meshforge.models.gpt_oss.args import OPTION_KEYS, GptOssArgs, from_options
from meshforge.models.spec import CPModules, FamilyArgs, FamilySpec, MoESpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import HFStateDictAdapter


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.gpt_oss.model import build_gpt_oss

    assert isinstance(args, GptOssArgs)
    return build_gpt_oss(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.gpt_oss.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _hf_adapter(spec: FamilySpec, args: FamilyArgs | None) -> HFStateDictAdapter:
    from meshforge.models.gpt_oss.hf import GptOssStateDictAdapter

    return GptOssStateDictAdapter(spec, args)


def _stage(b: StageBatch) -> LayerRunner:
    from meshforge.models.gpt_oss.stage import gpt_oss_stage

    return gpt_oss_stage(b)


def _cp_modules() -> CPModules:
    from meshforge.models.gpt_oss.model import GptOssModel

    return CPModules(decoders=(GptOssModel,), attentions=attention_classes())


def _experts() -> type[nn.Module]:
    from meshforge.models.gpt_oss.moe import GptOssExperts

    return GptOssExperts


FAMILY = FamilySpec(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    model_ids=("gpt_oss",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    adapter=_hf_adapter,
    tp_plan=_tp_plan,
    stage_preparation=_stage,
    cp_modules=_cp_modules,
    moe=MoESpec(expert_type=_experts, expert_count_key="model.num_local_experts", aux_reduce=aux_reduce),
)
