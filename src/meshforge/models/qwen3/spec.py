"""The Qwen3 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Parameter names are the HF safetensors keys (the identity
adapter).
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    builder,
    decoder_cp_modules,
    decoder_kv_cache,
    decoder_stage,
    tp_plan,
)
from meshforge.models.qwen3.args import OPTION_KEYS, Qwen3Args, from_options
from meshforge.models.spec import FamilySpec

FAMILY = FamilySpec(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    model_ids=("qwen3",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.qwen3.model:build_qwen3", Qwen3Args),
    tp_plan=tp_plan("meshforge.models.qwen3.parallelize"),
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    kv_cache=decoder_kv_cache,
)
