"""Registry entry of the built-in Qwen3-MoE family (light: imports only ``args.py``, no torch).

The lead registers ``FAMILY`` in ``meshforge.models.registry``; tests use it directly.
"""

from __future__ import annotations

from meshforge.models.qwen3_moe.args import OPTION_KEYS
from meshforge.models.registry import FamilySpec

FAMILY = FamilySpec(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_ids=("qwen3_moe",),
    option_keys=OPTION_KEYS,
    args_module="meshforge.models.qwen3_moe.args",
    model_module="meshforge.models.qwen3_moe.model",
    hf_module="meshforge.models.qwen3_moe.hf",
)
