"""DeepSeek-V3's tensor-parallel plan: multi-head latent attention split by heads, MoE kept whole.

The `deepseek_v3` spec (`spec.py`) takes its plan from this module. The
embedding, norms, dense MLP layers (the first `first_k_dense_replace`) and head follow the
shared dense-decoder plan (`meshforge.models.common.tp_plan.decoder_tp_plan`). The attention
(`meshforge.models.common.mla`) is split by heads:

| module                                   | style                                          |
| ---------------------------------------- | ---------------------------------------------- |
| `q_proj`, or `q_b_proj` (low-rank query) | ColwiseParallel: each rank's heads             |
| `q_a_proj`, `q_a_layernorm`              | whole on every rank (they feed all heads)      |
| `kv_a_proj_with_mqa`, `kv_a_layernorm`   | whole on every rank (the latent and the rotated key feed all heads) |
| `kv_b_proj`                              | ColwiseParallel (per head: positionless key, then value) |
| `o_proj`                                 | RowwiseParallel                                |

The attention module reshapes with `num_heads`, which becomes the local head count (set by
the plan's `SplitHeads` style, not in the model code). The attention input is whole on every
rank (all-gathered under SP) and handed over as a plain tensor, since the unsplit projections
compute with plain local weights.

Gradients of the unsplit part: a column-split projection's input gradient is summed over the
TP ranks by its own input preparation (the latent and the low-rank query get the full
gradient), but the rotated key part of `kv_a_proj_with_mqa`'s output is one head that every
head uses, and each rank only uses it in its local heads: its gradient is summed over the TP
ranks by a hook on that projection's output (`_SumRopeKeyGrad`), after which every unsplit
weight gets the full gradient, the same on each rank.

Multi-token-prediction blocks (`mtp.py`) are decoder layers planned as above; under SP their
`enorm`, `hnorm` and `shared_head.norm` are SequenceParallel and `eh_proj` is column-split
between a gathered input and a sequence-split output (without SP all three run whole on
replicated activations, like the other unplanned parameters).

A sparse block (sigmoid router, correction bias, routed and shared experts) is not split:
every TP rank runs it over all the tokens with replicated weights, so its output, gradients
and per-expert counts are exactly those of one process (as Qwen3-MoE's plan does; splitting
experts is `expert_parallel`'s job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import SplitHeads, attention_input, checked_plan, decoder_tp_plan
from meshforge.models.deepseek_v3.args import DeepseekV3Args

if TYPE_CHECKING:
    from meshforge.models.common.mla import MultiHeadLatentAttention


def tp_sizes(args: DeepseekV3Args) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    sizes = {"num_attention_heads": args.num_attention_heads, "vocab_size": args.vocab_size}
    if any(not args.is_moe_layer(i) for i in range(args.num_hidden_layers)):
        sizes["intermediate_size"] = args.intermediate_size  # dense MLP layers are split
    return sizes


class _SumTailGrad(torch.autograd.Function):
    """Identity forward; backward sums the last `width` features of the gradient over `mesh`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, mesh: DeviceMesh) -> torch.Tensor:
        ctx.width, ctx.mesh = width, mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        head, tail = grad.split([grad.shape[-1] - ctx.width, ctx.width], dim=-1)
        tail = funcol.wait_tensor(funcol.all_reduce(tail.contiguous(), "sum", ctx.mesh))
        return torch.cat([head, tail], dim=-1), None, None


class _SumRopeKeyGrad(ParallelStyle):
    """On `kv_a_proj_with_mqa`: sum the gradient of its rotated-key output over the TP ranks.

    The projection stays whole (its weight becomes a replicated DTensor later, as every
    unsplit parameter does); only its output's backward changes.
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module: nn.Module, _args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
            return _SumTailGrad.apply(output, self.rope_dim, device_mesh)

        module.register_forward_hook(hook)
        return module


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `DeepseekV3ForCausalLM` (or a pipeline stage of one)."""
    plan = decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        replicated_mlp=lambda layer: bool(getattr(layer, "is_moe", False)),
        replicated_mlp_extra_inputs=0,  # DeepSeek's sparse block takes the hidden states only
    )
    seq = Shard(1)
    for path, layer in model.get_submodule("model.layers").named_children():
        # Every DeepSeek-V3 decoder layer's self_attn is the latent attention.
        attn = cast("MultiHeadLatentAttention", layer.self_attn)
        prefix = f"model.layers.{path}.self_attn"
        # The shared plan's q/k/v entries are those of a plain attention: replaced here.
        for key in [k for k in plan if k == prefix or k.startswith(prefix + ".")]:
            del plan[key]
        plan[prefix] = SplitHeads(
            head_attrs=("num_heads",),
            inner=attention_input(sequence_parallel=sequence_parallel, local=True),
        )
        plan[f"{prefix}.{'q_proj' if attn.q_lora_rank is None else 'q_b_proj'}"] = ColwiseParallel()
        plan[f"{prefix}.kv_a_proj_with_mqa"] = _SumRopeKeyGrad(attn.qk_rope_head_dim)
        plan[f"{prefix}.kv_b_proj"] = ColwiseParallel()
        plan[f"{prefix}.o_proj"] = RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
        if sequence_parallel and hasattr(layer, "eh_proj"):
            # An MTP block (mtp.py): its norms see this rank's slice of the sequence (replicated
            # weights, gradients summed over TP); the projection gathers the sequence, splits its
            # output features and hands each rank its sequence slice back for the layer.
            block = f"model.layers.{path}"
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                plan[f"{block}.{norm}"] = SequenceParallel()
            plan[f"{block}.eh_proj"] = ColwiseParallel(input_layouts=seq, output_layouts=seq)
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
