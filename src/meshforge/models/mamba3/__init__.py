"""Built-in Mamba-3 family (MindSpeed ``model_id: mamba3``): a stack of Mamba-3 state-space mixers.

Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao, Gu: "Mamba-3: Improved Sequence Modeling
using State Space Principles", 2026, arXiv:2603.15569) changes Mamba-2 in three ways, all
built here in plain PyTorch: the exponential-trapezoidal discretisation (each update also
looks back at the previous token's input, weighted by a data-dependent ``lambda``), a
complex-valued state written as data-dependent rotary angles on B and C, and MIMO heads
(``mimo_rank`` input/output channels per head).

Sources: the reference layer ``mamba_ssm/modules/mamba3.py`` of github.com/state-spaces/mamba
(its parameters, order of ``in_proj``, initialisation) and the pure-PyTorch reference functions
of its tests (``tests/ops/triton/test_mamba3_siso.py``: ``mamba3_siso_step_ref``,
``mamba3_siso_fwd_ref``; ``tests/ops/tilelang/test_mamba3_mimo.py``: ``mamba3_MIMO_step_ref``);
flash-linear-attention's ``fla/models/mamba3`` (the pre-norm block, ``config.json`` names);
MindSpeed-LLM's ``mindspeed_llm/fsdp2/models/mamba3/modeling_mamba3.py`` (``Mamba3ForCausalLM``
over the mamba_ssm layer, SISO). See ``docs/mamba3.md``.

Modules: ``args.py`` (light: ``Mamba3Args``, flavors, option parsing), ``scan.py`` (the
chunked scan and the token-by-token recurrence), ``mixer.py`` (the layer), ``model.py``
(``Mamba3ForCausalLM``), ``hf.py`` (safetensors names), ``parallelize.py`` (TP), ``stage.py``
(PP) and ``spec.py`` (``FAMILY``). This file imports none of them.
"""
