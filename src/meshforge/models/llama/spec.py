"""Registry entry of the built-in Llama family (light: imports neither torch nor the model).

``meshforge.models.registry`` adds ``FAMILY`` to its table; it resolves from
``model_type: llama`` or ``architectures: LlamaForCausalLM``. MindSpeed has no
``model_id`` for Llama, so none selects it.
"""

from __future__ import annotations

from meshforge.models.llama.args import OPTION_KEYS
from meshforge.models.registry import FamilySpec

FAMILY = FamilySpec(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    model_ids=(),
    option_keys=OPTION_KEYS,
    args_module="meshforge.models.llama.args",
    model_module="meshforge.models.llama.model",
)
