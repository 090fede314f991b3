"""The Step-3.5 family's spec (``model_type: step3p5``; MindSpeed ``step35``).

Light: imports only ``args.py``; each function below imports the family's torch module when
called. Context parallelism is not built for this family (sliding-window layers with their own
head counts and RoPE per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.spec import FamilyArgs, FamilySpec, MoESpec
from meshforge.models.step3p5.args import OPTION_KEYS, Step3p5Args, from_options

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch
    from meshforge.models.spec import HFStateDictAdapter


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.step3p5.model import build_step3p5

    assert isinstance(args, Step3p5Args)
    return build_step3p5(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.step3p5.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _stage(b: StageBatch) -> LayerRunner:
    from meshforge.models.step3p5.parallelize import step3p5_stage

    return step3p5_stage(b)


def _hf_adapter(spec: FamilySpec, args: FamilyArgs | None) -> HFStateDictAdapter:
    from meshforge.models.step3p5.hf import state_dict_adapter

    assert args is None or isinstance(args, Step3p5Args)
    return state_dict_adapter(spec, args)


def _experts() -> type[nn.Module]:
    from meshforge.models.step3p5.model import Step3p5Experts

    return Step3p5Experts


FAMILY = FamilySpec(
    name="step3p5",
    hf_architectures=("Step3p5ForCausalLM",),
    model_ids=("step35", "step3p5"),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    adapter=_hf_adapter,
    tp_plan=_tp_plan,
    stage_preparation=_stage,
    cp_methods=(),
    cp_refusal="context parallelism is not built for step3p5 (per-layer heads, RoPE and sliding windows)",
    moe=MoESpec(expert_type=_experts, expert_count_key="model.moe_num_experts"),
)
