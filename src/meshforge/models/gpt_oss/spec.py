"""Registry entry of the built-in gpt-oss family (light: imports only ``args.py``, no torch)."""

from __future__ import annotations

from meshforge.models.gpt_oss.args import OPTION_KEYS
from meshforge.models.registry import FamilySpec

FAMILY = FamilySpec(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    model_ids=("gpt_oss",),
    option_keys=OPTION_KEYS,
    args_module="meshforge.models.gpt_oss.args",
    model_module="meshforge.models.gpt_oss.model",
    hf_module="meshforge.models.gpt_oss.hf",
)
