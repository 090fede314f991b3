"""The Qwen3-Next family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Its linear-attention layers hold a Gated DeltaNet under
``linear_attn``: CP splits its key heads (ulysses only), generation keeps its recurrent state.
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    adapter,
    aux_reduce,
    builder,
    cp_modules,
    grouped_experts,
    kv_cache_modules,
    stage,
    tp_plan,
)
from meshforge.models.qwen3_next.args import OPTION_KEYS, Qwen3NextArgs, from_options
from meshforge.models.spec import FamilySpec, MoESpec

_MODEL = "meshforge.models.qwen3_next.model:Qwen3NextModel"
_DELTANET = "meshforge.models.qwen3_next.gdn:GatedDeltaNet"

FAMILY = FamilySpec(
    name="qwen3_next",
    hf_architectures=("Qwen3NextForCausalLM",),
    model_ids=("qwen3_next",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.qwen3_next.model:build_qwen3_next", Qwen3NextArgs),
    adapter=adapter("meshforge.models.qwen3_next.hf:state_dict_adapter"),
    tp_plan=tp_plan("meshforge.models.qwen3_next.parallelize"),
    stage_preparation=stage("meshforge.models.qwen3_next.stage:qwen3_next_stage"),
    cp_modules=cp_modules(_MODEL, mixers=(_DELTANET,)),
    cp_methods=("ulysses",),
    cp_refusal=(
        "its Gated DeltaNet layers run a recurrence (and a causal conv) whose state is carried "
        "token by token along the whole sequence, across the CP ranks' slices, which the "
        "attention-only exchanges (colossal/ring, kvallgather, hybrid) cannot hand over; use "
        "context_parallel_method ulysses (whole rows per head slice, as the reference does)"
    ),
    moe=MoESpec(expert_type=grouped_experts, expert_count_key="model.num_experts", aux_reduce=aux_reduce),
    kv_cache=kv_cache_modules(
        _MODEL,
        recurrent=_DELTANET,
        new_state="meshforge.models.qwen3_next.gdn:DeltaNetState",
        mixer_attributes=("linear_attn", "self_attn"),
    ),
)
