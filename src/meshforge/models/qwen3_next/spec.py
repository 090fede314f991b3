"""Registry entry of the built-in Qwen3-Next family (light: imports only ``args.py``, no torch).

Registered through ``_SPEC_MODULES`` in ``meshforge.models.registry``; tests use it directly.
"""

from __future__ import annotations

from meshforge.models.qwen3_next.args import OPTION_KEYS
from meshforge.models.registry import FamilySpec

FAMILY = FamilySpec(
    name="qwen3_next",
    hf_architectures=("Qwen3NextForCausalLM",),
    model_ids=("qwen3_next",),
    option_keys=OPTION_KEYS,
    args_module="meshforge.models.qwen3_next.args",
    model_module="meshforge.models.qwen3_next.model",
    hf_module="meshforge.models.qwen3_next.hf",
)
