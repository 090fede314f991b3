"""Built-in DeepSeek-V3 family: ``args.py`` (light: ``DeepseekV3Args``, flavors, option parsing),
``model.py`` (torch: ``DeepseekV3ForCausalLM`` with transformers' in-memory names, MLA,
sigmoid group-limited routing, shared experts, tokens per expert), ``hf.py`` (per-expert
safetensors keys <-> fused experts) and ``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
