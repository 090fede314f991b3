"""MiniMax-M2's tensor-parallel plan: attention split by heads with width norms, experts whole.

The `minimax_m2` spec (`spec.py`) takes its plan from this module. The embedding, the
projections, the norms and the head follow the shared dense-decoder plan
(`meshforge.models.common.tp_plan.decoder_tp_plan`): `q/k/v_proj` column-wise (whole heads per
rank), `o_proj` row-wise. The q/k norms span the whole projection width, so each rank holds the
slice of their weight that belongs to its heads (`Shard(0)`, swapped in as a local tensor for
the forward by `SplitHeads`) and sums its squares with the other ranks' (the norm's `group`):
the normalised values are those of one process. The sparse block is not split (every TP rank
runs it over all tokens with replicated weights, as Qwen3-MoE's plan does); expert parallelism
splits the experts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import SplitHeads, checked_plan, decoder_tp_plan
from meshforge.models.minimax_m2.args import MiniMaxM2Args
from meshforge.models.minimax_m2.model import MiniMaxM2Attention


def tp_sizes(args: MiniMaxM2Args) -> dict[str, int]:
    """The `model.*` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    return {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "vocab_size": args.vocab_size,
    }


class _WidthNormHeads(SplitHeads):
    """`SplitHeads` for the attention, also giving its width norms the TP group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, MiniMaxM2Attention)  # the plan puts this style on self_attn only
        module.q_norm.group = module.k_norm.group = device_mesh.get_group()
        return super()._apply(module, device_mesh)


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """`{module path: ParallelStyle}` for a `MiniMaxM2ForCausalLM` (or a pipeline stage of one)."""
    plan = decoder_tp_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        replicated_mlp=lambda layer: True,
    )
    for path, _ in model.get_submodule("model.layers").named_children():
        key = f"model.layers.{path}.self_attn"
        plan[key] = _WidthNormHeads(sharded=("q_norm.weight", "k_norm.weight"), inner=plan.get(key))
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
