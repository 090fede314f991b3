"""The Step-3.5 family's spec (``model_type: step3p5``; MindSpeed ``step35``).

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Context parallelism is not built for this family
(sliding-window layers with their own head counts and RoPE per layer). The generation cache
hands its inner model one mask per layer kind (full, sliding).
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    adapter,
    builder,
    kv_cache_modules,
    module_class,
    stage,
    tp_plan,
)
from meshforge.models.spec import FamilySpec, MoESpec
from meshforge.models.step3p5.args import OPTION_KEYS, Step3p5Args, from_options

FAMILY = FamilySpec(
    name="step3p5",
    hf_architectures=("Step3p5ForCausalLM",),
    model_ids=("step35",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.step3p5.model:build_step3p5", Step3p5Args),
    adapter=adapter("meshforge.models.step3p5.hf:state_dict_adapter"),
    tp_plan=tp_plan("meshforge.models.step3p5.parallelize"),
    stage_preparation=stage("meshforge.models.step3p5.parallelize:step3p5_stage"),
    cp_methods=(),
    cp_refusal="context parallelism is not built for step3p5 (per-layer heads, RoPE and sliding windows)",
    moe=MoESpec(
        expert_type=module_class("meshforge.models.step3p5.model:Step3p5Experts"),
        expert_count_key="model.moe_num_experts",
    ),
    kv_cache=kv_cache_modules("meshforge.models.step3p5.model:Step3p5Model", masks_by_layer_kind=True),
)
