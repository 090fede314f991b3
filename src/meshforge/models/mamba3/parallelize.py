"""Mamba-3's tensor-parallel plan: the mixers split by heads, each rank keeping whole heads.

* The embedding, the block norms (sequence-parallel under SP), the final norm and the head
  follow the dense decoder's layout (vocab-split embedding and head).
* ``mixer.in_proj`` holds ``[z, x, B, C, dd_dt, dd_A, trap, angles]`` (the reference's order,
  kept so checkpoints load as they are). Its weight stays whole on every rank; each rank
  multiplies with its own rows (its heads' z, x, dd_dt, dd_A, trap; B and C of its groups, or
  all of them with one group; all angle rows), so the weight's gradient is a sum over the TP
  ranks (``SplitHeads`` ``summed`` with a row index).
* Per-head parameters (``dt_bias``, ``B_bias``, ``C_bias``, ``D``, ``mimo_x/z/o``, the
  gated norm's weight) are split ``Shard(0)``; ``B_norm``/``C_norm`` (shared by the heads of a
  group) are kept whole with gradients summed; ``num_heads`` (and ``n_groups`` when the groups
  are split) become the local counts.
* The mixer's input is whole on every rank (all-gathered under SP); its gradient is a sum of
  each rank's heads' terms, so it is reduced over TP on the way back (reduce-scattered under
  SP). ``out_proj`` is row-split.

The scan runs along the whole sequence on every rank, over its own heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import SplitHeads, checked_plan
from meshforge.models.mamba3.args import Mamba3Args


def tp_sizes(args: Mamba3Args) -> dict[str, int]:
    """The ``model.*`` sizes tensor parallelism splits (each must be a multiple of the TP degree)."""
    sizes = {"vocab_size": args.vocab_size, "num_heads": args.num_heads}
    if args.n_groups > 1:
        sizes["n_groups"] = args.n_groups
    return sizes


def _in_proj_rows(args: Mamba3Args) -> Callable[[int, int], torch.Tensor]:
    """``(rank, tp) -> indices`` of the ``in_proj`` rows a rank multiplies with."""
    h, p, n, r, g, angles = (
        args.num_heads,
        args.head_dim,
        args.state_size,
        args.rank,
        args.n_groups,
        args.num_rope_angles,
    )
    d, bc = h * p, r * g * n

    def index(rank: int, tp: int) -> torch.Tensor:
        hl = h // tp
        heads = torch.arange(rank * hl * p, (rank + 1) * hl * p)
        if g > 1:
            gl = g // tp
            groups = torch.cat(
                [torch.arange(i * g * n + rank * gl * n, i * g * n + (rank + 1) * gl * n) for i in range(r)]
            )
        else:
            groups = torch.arange(bc)
        per_head = torch.arange(rank * hl, (rank + 1) * hl)
        base = 2 * d + 2 * bc
        return torch.cat(
            [
                heads,
                d + heads,
                2 * d + groups,
                2 * d + bc + groups,
                base + per_head,
                base + h + per_head,
                base + 2 * h + per_head,
                base + 3 * h + torch.arange(angles),
            ]
        )

    return index


class _WholeInput(ParallelStyle):
    """The mixer's input as a plain whole tensor whose gradient is summed over the TP ranks."""

    def __init__(self, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(functools.partial(self._prepare, mesh=device_mesh))
        return module

    def _prepare(
        self, _module: nn.Module, args: tuple[object, ...], *, mesh: DeviceMesh
    ) -> tuple[object, ...]:
        x = args[0]
        assert isinstance(x, torch.Tensor)  # the module's first input: the hidden states
        if not isinstance(x, DTensor):
            layout = Shard(1) if self.sequence_parallel else Replicate()
            x = DTensor.from_local(x, mesh, (layout,), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(mesh, (Replicate(),))
        # Each rank's heads give one term of the input's gradient: Partial, reduced going back.
        return (x.to_local(grad_placements=(Partial(),)), *args[1:])


def tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """``{module path: ParallelStyle}`` for a ``Mamba3ForCausalLM`` (or a pipeline stage of one)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    args = model.args
    assert isinstance(args, Mamba3Args)
    plan: dict[str, ParallelStyle] = {}
    inner = model.get_submodule("model")
    if getattr(inner, "embed_tokens", None) is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    sharded = ["dt_bias", "B_bias", "C_bias", "D"]
    if args.is_mimo:
        sharded += ["mimo_x", "mimo_z", "mimo_o"]
    if args.is_outproj_norm:
        sharded.append("norm.weight")
    rows = _in_proj_rows(args)
    for name, _layer in inner.get_submodule("layers").named_children():
        path = f"model.layers.{name}"
        if sequence_parallel:
            plan[f"{path}.norm"] = SequenceParallel()
        plan[f"{path}.mixer"] = SplitHeads(
            head_attrs=("num_heads", "n_groups") if args.n_groups > 1 else ("num_heads",),
            sharded=sharded,
            summed={"in_proj.weight": rows, "B_norm.weight": None, "C_norm.weight": None},
            inner=_WholeInput(sequence_parallel=sequence_parallel),
        )
        plan[f"{path}.mixer.out_proj"] = RowwiseParallel(output_layouts=seq)
    if sequence_parallel and getattr(inner, "norm", None) is not None:
        plan["model.norm"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


#: The family's ``TPPlan`` (``spec.py`` calls it): :func:`tp_sizes` checked, then :func:`tp_plan`.
checked_tp_plan = checked_plan(tp_plan, tp_sizes)
