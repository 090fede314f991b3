"""Built-in Llama family (Llama 3 / 3.1 / 3.2, incl. llama3 RoPE scaling).

``args.py`` (light: ``LlamaArgs``, flavors, option parsing), ``model.py`` (torch:
``LlamaForCausalLM`` with transformers' parameter names), ``parallelize.py`` (the TP plan) and
``spec.py`` (light: the family's ``FamilySpec``, ``FAMILY``). This file imports none of them, so
resolving the family from a config stays torch-free.
"""
