"""The DeepSeek-V3 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Its multi-head latent attention is one of the shared
attention modules, so the ``DecoderModel`` CP and KV-cache pieces cover it.
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    adapter,
    aux_reduce,
    builder,
    decoder_cp_modules,
    decoder_kv_cache,
    decoder_stage,
    grouped_experts,
    tp_plan,
)
from meshforge.models.deepseek_v3.args import OPTION_KEYS, DeepseekV3Args, from_options
from meshforge.models.spec import FamilySpec, MoESpec

FAMILY = FamilySpec(
    name="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    model_ids=(),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.deepseek_v3.model:build_deepseek_v3", DeepseekV3Args),
    adapter=adapter("meshforge.models.deepseek_v3.hf:state_dict_adapter"),
    tp_plan=tp_plan("meshforge.models.deepseek_v3.parallelize"),
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    moe=MoESpec(
        expert_type=grouped_experts, expert_count_key="model.n_routed_experts", aux_reduce=aux_reduce
    ),
    kv_cache=decoder_kv_cache,
)
