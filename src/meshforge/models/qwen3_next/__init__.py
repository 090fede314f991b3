"""Built-in Qwen3-Next family (hybrid Gated DeltaNet + gated attention, MoE with a shared expert):
``args.py`` (light: ``Qwen3NextArgs``, flavors, option parsing), ``gdn.py`` (torch: the chunked
gated delta rule, causal conv, gated norm, ``GatedDeltaNet``), ``model.py`` (torch:
``Qwen3NextForCausalLM`` with transformers' in-memory names), ``hf.py`` (per-expert safetensors
keys <-> fused experts) and ``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
