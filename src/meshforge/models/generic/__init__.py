"""The transformers path as one more family: any local ``AutoModelForCausalLM`` meshforge does not
build itself. ``spec.py`` (light: ``GenericFamily``, ``generic_family``, ``FAMILY``), ``model.py``
(the wrapper that gives a transformers model meshforge's forward and init contract), ``hf.py``
(checkpoints through transformers' weight-conversion mapping), ``parallelize.py`` (the TP plan
from module patterns), ``stage.py`` (pipeline stages), ``cp.py`` (context parallelism as an
attention implementation) and ``experts.py`` (expert parallelism on transformers' fused experts).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
