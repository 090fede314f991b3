"""The gpt-oss family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Its inner model gives each layer kind (full, sliding) its own
mask, so the generation cache hands it one mask per kind.
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    adapter,
    aux_reduce,
    builder,
    cp_modules,
    kv_cache_modules,
    module_class,
    stage,
    tp_plan,
)
from meshforge.models.gpt_oss.args import OPTION_KEYS, GptOssArgs, from_options
from meshforge.models.spec import FamilySpec, MoESpec

FAMILY = FamilySpec(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    model_ids=("gpt_oss",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.gpt_oss.model:build_gpt_oss", GptOssArgs),
    adapter=adapter("meshforge.models.gpt_oss.hf:GptOssStateDictAdapter"),
    tp_plan=tp_plan("meshforge.models.gpt_oss.parallelize"),
    stage_preparation=stage("meshforge.models.gpt_oss.stage:gpt_oss_stage"),
    cp_modules=cp_modules("meshforge.models.gpt_oss.model:GptOssModel"),
    moe=MoESpec(
        expert_type=module_class("meshforge.models.gpt_oss.moe:GptOssExperts"),
        expert_count_key="model.num_local_experts",
        aux_reduce=aux_reduce,
    ),
    kv_cache=kv_cache_modules("meshforge.models.gpt_oss.model:GptOssModel", masks_by_layer_kind=True),
)
