"""The Mamba-3 family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each piece imports its torch module when called
(``models/common/family_parts.py``). Context parallelism is refused (``cp_methods`` empty): see
``CP_REFUSAL``. Generation keeps each mixer's recurrent state (``Mamba3State``) between steps.
"""

from __future__ import annotations

from meshforge.models.common.family_parts import adapter, builder, kv_cache_modules, stage, tp_plan
from meshforge.models.mamba3.args import OPTION_KEYS, Mamba3Args, from_options
from meshforge.models.spec import FamilySpec

CP_REFUSAL = (
    "mamba3 is a state-space recurrence: every token's state depends on all earlier tokens of "
    "its document, so a rank holding a later slice of the sequence needs the state at the end of "
    "the slices before it, which no built CP method hands over (attention exchanges keys and "
    "values); set parallelism.context_parallel to 1 (MindSpeed cp_size) for mamba3"
)

FAMILY = FamilySpec(
    name="mamba3",
    hf_architectures=("Mamba3ForCausalLM",),
    model_ids=("mamba3",),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=builder("meshforge.models.mamba3.model:build_mamba3", Mamba3Args),
    adapter=adapter("meshforge.models.mamba3.hf:Mamba3StateDictAdapter"),
    tp_plan=tp_plan("meshforge.models.mamba3.parallelize"),
    stage_preparation=stage("meshforge.models.mamba3.stage:mamba3_stage"),
    cp_modules=None,
    cp_methods=(),
    cp_refusal=CP_REFUSAL,
    kv_cache=kv_cache_modules(
        "meshforge.models.mamba3.model:Mamba3Model",
        recurrent="meshforge.models.mamba3.mixer:Mamba3Mixer",
        new_state="meshforge.models.mamba3.mixer:Mamba3State",
        mixer_attributes=("mixer",),
    ),
)
