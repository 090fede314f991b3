"""Registry entry of the built-in DeepSeek-V3 family (light: imports only ``args.py``, no torch)."""

from __future__ import annotations

from meshforge.models.deepseek_v3.args import OPTION_KEYS
from meshforge.models.registry import FamilySpec

FAMILY = FamilySpec(
    name="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    model_ids=(),
    option_keys=OPTION_KEYS,
    args_module="meshforge.models.deepseek_v3.args",
    model_module="meshforge.models.deepseek_v3.model",
    hf_module="meshforge.models.deepseek_v3.hf",
)
