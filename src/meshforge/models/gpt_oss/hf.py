"""Adapter between gpt-oss' in-memory parameters and the keys transformers writes to safetensors.

Unlike Qwen3-MoE, transformers 5.24 saves gpt-oss' experts exactly as it keeps them
in memory (checked with ``save_pretrained`` on a tiny model), so every name maps to
itself with the same layout:

=============================================  ===========================================
safetensors key (= our parameter name)         shape
=============================================  ===========================================
``{p}.self_attn.{q,k,v,o}_proj.{weight,bias}``  as ``nn.Linear``
``{p}.self_attn.sinks``                         ``[heads]``
``{p}.mlp.router.weight`` / ``.bias``           ``[E, hidden]`` / ``[E]``
``{p}.mlp.experts.gate_up_proj``                ``[E, hidden, 2I]``, gate/up interleaved
``{p}.mlp.experts.gate_up_proj_bias``           ``[E, 2I]``
``{p}.mlp.experts.down_proj``                   ``[E, I, hidden]``
``{p}.mlp.experts.down_proj_bias``              ``[E, hidden]``
=============================================  ===========================================

So ``hf_sources``/``from_hf``/``to_hf`` keep the protocol defaults (which also lets the
FSDP loader read only each rank's slice). What this module adds is the config
mapping. OpenAI's MXFP4 release format (``*_blocks``/``*_scales`` expert tensors,
``quantization_config`` in config.json) is dequantised at load by
:mod:`meshforge.models.common.dequant`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshforge.models.common.hf_adapter import HFAdapterBase

if TYPE_CHECKING:
    from meshforge.models.gpt_oss.args import GptOssArgs

HF_ARCHITECTURE = "GptOssForCausalLM"


def to_hf_config(args: GptOssArgs) -> dict[str, object]:
    """``config.json`` content transformers loads as the same model (model_type, architectures, fields)."""
    return {"model_type": "gpt_oss", "architectures": [HF_ARCHITECTURE], **args.to_hf_dict()}


def from_hf_config(config: dict[str, object]) -> dict[str, object]:
    """``model:`` options from a gpt-oss ``config.json`` (keys the args know; the rest dropped).

    Raises:
        ValueError: For a ``quantization_config`` format the loader does not dequantise (MXFP4 is).
    """
    from meshforge.models.common.dequant import quantization_method
    from meshforge.models.gpt_oss.args import OPTION_KEYS

    # OpenAI's MXFP4 experts are dequantised at load (models/common/dequant.py); other formats fail here.
    quantization_method(config)
    return {k: v for k, v in config.items() if k in OPTION_KEYS and k != "flavor"}


class GptOssStateDictAdapter(HFAdapterBase):
    """The family's ``HFStateDictAdapter``: names and layouts as they are (MXFP4 decoded by the loader)."""

    hf_architecture = HF_ARCHITECTURE

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        return from_hf_config(dict(config))
