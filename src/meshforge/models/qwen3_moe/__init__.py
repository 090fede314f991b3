"""Built-in Qwen3-MoE family: ``args.py`` (light: ``Qwen3MoeArgs``, flavors, option parsing),
``model.py`` (torch: ``Qwen3MoeForCausalLM`` with transformers' in-memory names, aux loss,
tokens per expert), ``hf.py`` (per-expert safetensors keys <-> fused experts) and
``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
