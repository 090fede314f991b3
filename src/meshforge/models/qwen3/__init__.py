"""Built-in Qwen3 family: ``args.py`` (light: ``Qwen3Args``, flavors, option parsing),
``model.py`` (torch: ``Qwen3ForCausalLM`` with transformers' parameter names), ``parallelize.py``
(the TP plan) and ``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
