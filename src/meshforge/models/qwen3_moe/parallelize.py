"""Qwen3-MoE's tensor-parallel plan: Qwen3's attention split, the routed experts kept whole.

The `qwen3_moe` spec (`spec.py`) takes its plan from this module. Attention,
the dense MLP layers (`mlp_only_layers`, `decoder_sparse_step`), the embedding, norms and head
follow the shared dense-decoder plan (`meshforge.models.common.tp_plan.decoder_tp_plan`, with the
per-head `q_norm`/`k_norm` as in Qwen3). A sparse block (router and fused experts) is not split:
every TP rank runs it over all the tokens with replicated weights, so its output, its gradients,
the router aux loss and the per-expert token counts are exactly those of one process; under
sequence parallelism its input is all-gathered first and each rank keeps its own sequence slice
of the output. Splitting the experts themselves is expert parallelism's job (`expert_parallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import checked_plan, decoder_tp_plan
from meshforge.models.qwen3_moe.args import Qwen3MoeArgs


def tp_sizes(args: Qwen3MoeArgs) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    assert args.num_key_value_heads is not None  # __post_init__ resolves a None
    sizes = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "vocab_size": args.vocab_size,
    }
    if any(not args.is_moe_layer(i) for i in range(args.num_hidden_layers)):
        sizes["intermediate_size"] = args.intermediate_size  # dense MLP layers are split
    return sizes


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `Qwen3MoeForCausalLM` (or a pipeline stage of one)."""
    return decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        head_norms=("q_norm", "k_norm"),
        replicated_mlp=lambda layer: bool(getattr(layer, "is_moe", False)),
    )


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
