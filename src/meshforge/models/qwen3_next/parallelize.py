"""Qwen3-Next's tensor-parallel plan: gated attention and Gated DeltaNet split by heads, MoE whole.

The `qwen3_next` spec (`spec.py`) takes its plan from this module. The
embedding, the zero-centred norms, the dense MLP layers and the head follow the shared
dense-decoder plan (`meshforge.models.common.tp_plan.decoder_tp_plan`). Each rank keeps whole heads
of both token mixers, so the per-head arithmetic is that of one process:

* Gated full attention (`self_attn`): `q_proj` emits, per head, `head_dim` query values then
  `head_dim` gate values, so a column split of it keeps whole heads with their gates (the
  forward reshapes with `-1` heads); `k/v_proj` column-wise, `o_proj` row-wise, and the per-head
  `q_norm`/`k_norm` replicated with gradients summed over TP, as in Qwen3.
* Gated DeltaNet (`linear_attn`, heads split by key head: each key head with the
  `linear_num_value_heads / linear_num_key_heads` value heads it serves):
  - `in_proj_qkvz` holds, per key head, its q, k, then its value heads' v and z; `in_proj_ba`
    per key head its value heads' b then a: both are split column-wise, whole groups per rank;
  - `A_log` and `dt_bias` (per value head) are split `Shard(0)`;
  - `conv1d` is depthwise over the channels `[q (all heads), k (all heads), v (all heads)]`,
    so a rank's channels are three separate blocks: the weight stays whole, each rank convolves
    with its own channels (gathered for the forward) and the gradient is summed over TP;
  - the gated norm (per value head, `head_v_dim`) is replicated with gradients summed;
  - `out_proj` is split row-wise; the module's head counts and `key_dim`/`value_dim` become the
    local ones.
  The recurrence runs along the whole sequence on every rank (under SP its input is
  all-gathered first), each rank over its own heads.

A sparse block (softmax router, fused experts, the gated shared expert) is not split: every TP
rank runs it over all the tokens with replicated weights, so its output, gradients, the router
aux loss and per-expert counts are exactly those of one process (as Qwen3-MoE's plan does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import SplitHeads, attention_input, checked_plan, decoder_tp_plan
from meshforge.models.qwen3_next.args import Qwen3NextArgs


def tp_sizes(args: Qwen3NextArgs) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    kinds = set(args.resolved_layer_types)
    sizes = {"vocab_size": args.vocab_size}
    if "full_attention" in kinds:
        sizes["num_attention_heads"] = args.num_attention_heads
        sizes["num_key_value_heads"] = args.num_key_value_heads
    if "linear_attention" in kinds:
        # Value heads are a multiple of key heads, so they split evenly too.
        sizes["linear_num_key_heads"] = args.linear_num_key_heads
    if any(not args.is_moe_layer(i) for i in range(args.num_hidden_layers)):
        sizes["intermediate_size"] = args.intermediate_size  # dense MLP layers are split
    return sizes


def _conv_channels(key_dim: int, value_dim: int) -> Callable[[int, int], torch.Tensor]:
    """`(rank, tp) -> indices` of a rank's conv channels: its slice of each of the q, k, v blocks."""

    def index(rank: int, tp: int) -> torch.Tensor:
        k, v = key_dim // tp, value_dim // tp
        return torch.cat(
            [
                torch.arange(rank * k, (rank + 1) * k),
                torch.arange(key_dim + rank * k, key_dim + (rank + 1) * k),
                torch.arange(2 * key_dim + rank * v, 2 * key_dim + (rank + 1) * v),
            ]
        )

    return index


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `Qwen3NextForCausalLM` (or a pipeline stage of one)."""
    plan = decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        head_norms=("q_norm", "k_norm"),
        replicated_mlp=lambda layer: bool(getattr(layer, "is_moe", False)),
    )
    out = Shard(1) if sequence_parallel else Replicate()
    for path, layer in model.get_submodule("model.layers").named_children():
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue  # gated attention: the shared plan's entries
        prefix = f"model.layers.{path}.linear_attn"
        plan[prefix] = SplitHeads(
            head_attrs=("num_k_heads", "num_v_heads", "key_dim", "value_dim"),
            sharded=("A_log", "dt_bias"),
            summed={"conv1d.weight": _conv_channels(gdn.key_dim, gdn.value_dim), "norm.weight": None},
            inner=attention_input(sequence_parallel=sequence_parallel, local=True),
        )
        plan[f"{prefix}.in_proj_qkvz"] = ColwiseParallel()
        plan[f"{prefix}.in_proj_ba"] = ColwiseParallel()
        plan[f"{prefix}.out_proj"] = RowwiseParallel(output_layouts=out)
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
