"""Built-in MiniMax-M2 family: ``args.py`` (light: ``MiniMaxM2Args``, flavors, option parsing),
``model.py`` (torch: ``MiniMaxM2ForCausalLM`` with transformers' in-memory names), ``hf.py``
(the ``block_sparse_moe`` per-expert safetensors keys <-> fused experts), ``parallelize.py`` (the
TP plan) and ``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
