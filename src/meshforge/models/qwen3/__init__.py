"""Built-in Qwen3 family: ``args.py`` (light: ``Qwen3Args``, flavors, option parsing) and
``model.py`` (torch: ``Qwen3ForCausalLM`` with transformers' parameter names).

This file imports neither, so resolving the family from a config stays torch-free.
"""
