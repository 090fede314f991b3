"""The Llama (3 / 3.1 / 3.2, incl. llama3 RoPE scaling) family's spec: everything the rest of meshforge needs of it.

Light: imports only ``args.py``; each function below imports the family's torch module when
called. MindSpeed has no ``model_id`` for Llama, so none selects it; parameter names are the HF
safetensors keys (the identity adapter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.models.common.family_parts import decoder_cp_modules, decoder_stage
from meshforge.models.llama.args import OPTION_KEYS, LlamaArgs, from_options
from meshforge.models.spec import FamilyArgs, FamilySpec

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle


def _build(args: FamilyArgs, device: str | torch.device) -> nn.Module:
    from meshforge.models.llama.model import build_llama

    assert isinstance(args, LlamaArgs)
    return build_llama(args, device=device)


def _tp_plan(
    model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    from meshforge.models.llama.parallelize import checked_tp_plan

    return checked_tp_plan(model, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


FAMILY = FamilySpec(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    model_ids=(),
    option_keys=OPTION_KEYS,
    from_options=from_options,
    builder=_build,
    tp_plan=_tp_plan,
    stage_preparation=decoder_stage,
    cp_modules=decoder_cp_modules,
)
