"""Llama's tensor-parallel plan: the shared dense-decoder plan as it is.

The `llama` spec (`spec.py`) takes its plan from this module. The layout is
`meshforge.models.common.tp_plan.decoder_tp_plan` (Megatron/torchtitan: column-split q/k/v and gate/up,
row-split o/down, vocab-split embedding and head, sequence-parallel norms). Llama has no per-head
norms; its optional attention and MLP biases follow their projections (column-split biases are
split, row-split biases stay replicated and are added once after the reduction).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import checked_plan, decoder_tp_plan
from meshforge.models.llama.args import LlamaArgs


def tp_sizes(args: LlamaArgs) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    assert args.num_key_value_heads is not None  # __post_init__ resolves a None
    return {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
    }


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `LlamaForCausalLM` (or a pipeline stage of one)."""
    return decoder_tp_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
