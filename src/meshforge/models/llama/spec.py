"""The Llama (3 / 3.1 / 3.2, incl. llama3 RoPE scaling) family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). MindSpeed has no ``model_id`` for Llama, so none selects it;
parameter names are the HF safetensors keys (the identity adapter).
"""

from __future__ import annotations

from meshforge.models.common.family_parts import (
    builder,
    decoder_cp_modules,
    decoder_kv_cache,
    decoder_stage,
    tp_plan,
)
from meshforge.models.llama.args import OPTION_KEYS, LlamaArgs, from_options
from meshforge.models.spec import FamilySpec

FAMILY = FamilySpec(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    model_ids=(),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.llama.model:build_llama", LlamaArgs),
    tp_plan=tp_plan("meshforge.models.llama.parallelize"),
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
    kv_cache=decoder_kv_cache,
)
