"""gpt-oss' tensor-parallel plan: sink attention split by heads, every MoE block kept whole.

The `gpt_oss` spec (`spec.py`) takes its plan from this module. The embedding,
norms and head follow the shared dense-decoder plan (`meshforge.models.common.tp_plan.decoder_tp_plan`).
The attention (`meshforge.models.common.sink_attention`) is split as a plain GQA attention is:
`q/k/v_proj` column-wise with their biases, `o_proj` row-wise (its bias added once, after the
reduction), so each rank holds whole query heads together with the key/value heads they read
(query head `h` belongs to key/value head `h // groups`, and both are split into contiguous
blocks). On top of that (the plan's `SplitHeads` style):

* the per-head sink logits `sinks` are split `Shard(0)` with the query heads;
* the module's `num_heads` and `num_kv_heads`, which its forward reshapes with, become the
  local counts.

Sliding-window and full-attention layers differ only in the mask the model builds, which is
the same on every rank (the attention sees the whole sequence; under SP its input is
all-gathered first), so both kinds are split alike.

Every gpt-oss layer is sparse: the router and the fused experts (with their biases) are not
split. Each TP rank runs the block over all the tokens with replicated weights, so its output,
gradients, router aux loss and per-expert counts are exactly those of one process (as
Qwen3-MoE's plan does; splitting experts is `expert_parallel`'s job).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import SplitHeads, attention_input, checked_plan, decoder_tp_plan
from meshforge.models.gpt_oss.args import GptOssArgs


def tp_sizes(args: GptOssArgs) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    assert args.num_key_value_heads is not None  # __post_init__ resolves a None
    return {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "vocab_size": args.vocab_size,
    }


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `GptOssForCausalLM` (or a pipeline stage of one)."""
    plan = decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        replicated_mlp=lambda _layer: True,
    )
    for path, _layer in model.get_submodule("model.layers").named_children():
        # Replaces the shared plan's input preparation of `self_attn` (the q/k/v/o entries stay).
        plan[f"model.layers.{path}.self_attn"] = SplitHeads(
            head_attrs=("num_heads", "num_kv_heads"),
            sharded=("sinks",),
            inner=attention_input(sequence_parallel=sequence_parallel, local=False),
        )
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
