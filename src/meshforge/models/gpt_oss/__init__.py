"""Built-in gpt-oss family: ``args.py`` (light: ``GptOssArgs``, flavors, option parsing),
``model.py`` (torch: ``GptOssForCausalLM`` with transformers' in-memory names, attention
sinks, alternating sliding/full attention, aux loss, tokens per expert), ``moe.py`` (biased
top-k router, clamped-SwiGLU experts), ``hf.py`` (config.json mapping; safetensors keys are
the in-memory names) and ``spec.py`` (the family's ``FamilySpec``, ``FAMILY``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
