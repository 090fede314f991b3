"""The Qwen3-MoE family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``).
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
from meshforge.models.qwen3_moe.args import OPTION_KEYS, Qwen3MoeArgs, from_options
from meshforge.models.spec import FamilySpec, MoESpec

FAMILY = FamilySpec(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_ids=("qwen3_moe",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.qwen3_moe.model:build_qwen3_moe", Qwen3MoeArgs),
    adapter=adapter("meshforge.models.qwen3_moe.hf:state_dict_adapter"),
    tp_plan=tp_plan("meshforge.models.qwen3_moe.parallelize"),
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    moe=MoESpec(expert_type=grouped_experts, expert_count_key="model.num_experts", aux_reduce=aux_reduce),
    kv_cache=decoder_kv_cache,
)
