"""The MiniMax-M2 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). MindSpeed names the model ``minimax_m27`` (its
``model_id``). Its attention derives from the common one (width norms and partial RoPE before
the cache hook), so the ``DecoderModel`` cache modules serve it.
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
from meshforge.models.minimax_m2.args import OPTION_KEYS, MiniMaxM2Args, from_options
from meshforge.models.spec import FamilySpec, MoESpec

FAMILY = FamilySpec(
    name="minimax_m2",
    hf_architectures=("MiniMaxM2ForCausalLM",),
    model_ids=("minimax_m27",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.minimax_m2.model:build_minimax_m2", MiniMaxM2Args),
    adapter=adapter("meshforge.models.minimax_m2.hf:state_dict_adapter"),
    tp_plan=tp_plan("meshforge.models.minimax_m2.parallelize"),
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    moe=MoESpec(
        expert_type=grouped_experts, expert_count_key="model.num_local_experts", aux_reduce=aux_reduce
    ),
    kv_cache=decoder_kv_cache,
)
