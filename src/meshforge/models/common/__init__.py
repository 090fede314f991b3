"""Single-device building blocks shared by the built-in model families.

Norms, rotary embeddings, attention and the gated MLP live here so each family's
``model.py`` only wires them together under Hugging Face module names. Parallelism
is applied from outside (``meshforge.parallel``), never inside these modules.
Submodules import torch; this package file stays light.
"""
