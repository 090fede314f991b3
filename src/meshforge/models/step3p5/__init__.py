"""Built-in Step-3.5 family (``model_type: step3p5``, MindSpeed ``step35``): ``args.py`` (light:
``Step3p5Args``, flavors, option parsing), ``model.py`` (torch: ``Step3p5ForCausalLM``),
``hf.py`` (the published per-projection expert keys <-> fused experts), ``parallelize.py`` (the
TP plan and the pipeline stage preparation) and ``spec.py`` (the family's ``FamilySpec``).

This file imports none of them, so resolving the family from a config stays torch-free.
"""
