"""Step-3.5's tensor-parallel plan and pipeline stage preparation.

TP: each layer's attention is split by heads with its own counts (full and sliding layers
differ; both must divide by the TP degree): `q/k/v_proj` and the head-wise gate `g_proj`
column-wise, `o_proj` row-wise, the per-head `q_norm`/`k_norm` replicated with gradients summed
over TP (as in Qwen3). Dense `mlp` and the sparse layers' `share_expert` are split like a dense
MLP; the routed block `moe` (router, bias, experts) is kept whole on every TP rank, over all
tokens (under sequence parallelism its input is all-gathered and each rank keeps its slice of
the output), so routing and counts are exactly those of one process. Embedding, norms and head
follow the shared dense-decoder plan.

PP: a stage builds the masks its own layers need (causal per document, and the sliding band
when one of them slides) and hands every layer the positions; each attention computes its own
RoPE.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.attention import positions_from_segments
from meshforge.models.common.stage import LayerRunner, StageBatch
from meshforge.models.common.tp_plan import checked_plan, decoder_tp_plan
from meshforge.models.step3p5.args import Step3p5Args
from meshforge.models.step3p5.model import layer_masks


def tp_sizes(args: Step3p5Args) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    sizes = {
        "num_attention_heads": args.num_attention_heads,
        "num_attention_groups": args.num_attention_groups,
        "vocab_size": args.vocab_size,
    }
    kinds = {args.layer_kind(i) for i in range(args.num_hidden_layers)}
    if "sliding_attention" in kinds:
        heads, groups = args.sliding_heads
        sizes["attention_other_setting.num_attention_heads"] = heads
        sizes["attention_other_setting.num_attention_groups"] = groups
    moe = [args.is_moe_layer(i) for i in range(args.num_hidden_layers)]
    if not all(moe):
        sizes["intermediate_size"] = args.intermediate_size
    if any(moe):
        sizes["share_expert_dim"] = args.share_expert_dim
    return sizes


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `Step3p5ForCausalLM` (or a pipeline stage of one)."""
    plan = decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        head_norms=("q_norm", "k_norm"),
        replicated_mlp=lambda layer: bool(getattr(layer, "is_moe", False)),
        replicated_mlp_extra_inputs=0,
    )
    seq = Shard(1)
    for name, layer in model.get_submodule("model.layers").named_children():
        path = f"model.layers.{name}"
        if layer.get_submodule("self_attn").g_proj is not None:
            plan[f"{path}.self_attn.g_proj"] = ColwiseParallel()
        if not getattr(layer, "is_moe", False):
            continue
        whole = plan.pop(f"{path}.mlp", None)  # the routed block is `moe` here
        if whole is not None:
            plan[f"{path}.moe"] = whole
            plan[f"{path}.share_expert"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
        plan[f"{path}.share_expert.gate_proj"] = ColwiseParallel()
        plan[f"{path}.share_expert.up_proj"] = ColwiseParallel()
        plan[f"{path}.share_expert.down_proj"] = RowwiseParallel(
            output_layouts=seq if sequence_parallel else Replicate()
        )
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)


def step3p5_stage(b: StageBatch) -> LayerRunner:
    """``Step3p5Model.forward``'s preparation for the stage's layers: masks and positions."""
    positions = b.position_ids
    if b.segment_ids is not None and positions is None:
        positions = positions_from_segments(b.segment_ids)
    masks = layer_masks(b.layers, b.segment_ids, b.seq_len, b.h.device, b.inner.sliding_window)
    return lambda layer, x: layer(x, positions, masks)
