"""Apply every parallel dimension to a meta-device model, in the one fixed order.

DESIGN.md fixes the order: low-precision conversion (`float8.apply_quantization`) -> PP split ->
TP/SP -> EP -> CP -> LoRA adapters -> recompute/swap (`memory.apply`) -> chunked micro-batches ->
compile -> FSDP. The adapters come after TP because
each one reads its base weight's TP placement to shard like it, and before FSDP so that each
lands in its decoder layer's unit next to its frozen base.
Each step is a function of its own module (`pipeline.split_model`, `tensor.apply_tp`,
`expert.apply_ep`, `context.apply_cp`, `fsdp.apply_fsdp`) that takes its mesh view and
explicit options; this module only decides which run and in what order, so the trainer
and tests share one path and the order is written down once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn as nn

from meshforge.memory.apply import ActivationMemory, ActivationSettings
from meshforge.parallel.config import MS_EP_MODULES, MS_LAYER_MODULES, ParallelismConfig
from meshforge.parallel.dims import ParallelDims, ParallelMesh
from meshforge.utils.dtype import parse_dtype

if TYPE_CHECKING:
    from meshforge.lora.apply import LoraApplied, LoraSettings
    from meshforge.models.spec import FamilySpec
    from meshforge.parallel.float8 import QuantPlan, QuantSettings
    from meshforge.parallel.fsdp.apply import ReshardPolicy
    from meshforge.parallel.pipeline import PipelineSplit


class _FsdpOptions(TypedDict):
    """The arguments `apply_fsdp` and `apply_fsdp_patterns` share."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype
    reshard_policy: ReshardPolicy
    ignored_modules: list[str] | None
    shard_placement: str | None
    hook_modules: list[str] | None


@dataclass
class ParallelizedModel:
    """The model this rank trains, and the pipeline split when pp > 1 (else None)."""

    model: nn.Module
    pipeline_split: PipelineSplit | None = None
    fsdp: bool = False
    activation: ActivationMemory | None = None
    lora: LoraApplied | None = None
    quant: QuantPlan | None = None


def parallelize_model(
    model: nn.Module,
    *,
    family: FamilySpec,
    dims: ParallelDims,
    mesh: ParallelMesh,
    parallelism: ParallelismConfig,
    param_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    compile_blocks: bool,
    apply_compile: Callable[[nn.Module], object] | None = None,
    activation: ActivationSettings | None = None,
    lora: LoraSettings | None = None,
    reduce_dtype: torch.dtype | None = None,
    quant: QuantSettings | None = None,
    device: torch.device | None = None,
) -> ParallelizedModel:
    """Split, shard and wrap `model` (on the meta device) for this rank.

    Args:
        family: the model's family spec; every step asks it for its piece (TP plan, stage
            preparation, CP modules, experts, FSDP units).
        parallelism: the `parallelism` config section.
        param_dtype: dtype the parameters are stored in; `compute_dtype` the forward's dtype.
        compile_blocks: `kernels.compile`; `apply_compile` does it (before FSDP).
        activation: the `recompute`, `recompute_comm` and `swap` sections (None: all off).
        lora: the adapter settings (`lora_config`); None = full fine-tuning.
        reduce_dtype: FSDP's gradient reduce dtype when it is not `parallelism.reduce_dtype`
            (`optimizer.accumulate_allreduce_grads_in_fp32: false` reduces in the low-precision
            dtype: `optim.grad_accum.reduce_dtype_for`).
        quant: the checked `model.quant_*` keys (`parallel.float8`); linear layers are converted
            first, before the pipeline split, TP and FSDP. `device`: where the run computes.
    """
    par = parallelism
    split = None
    quant_plan = None
    if quant is not None:
        from meshforge.parallel.float8 import apply_quantization

        if dims.tp > 1:
            raise NotImplementedError(
                f"not supported yet: model.quant_recipe_name={quant.recipe} with "
                f"parallelism.tensor_parallel={dims.tp} (float8 tensor-parallel styles)"
            )
        quant_plan = apply_quantization(
            model,
            quant,
            device=device if device is not None else torch.device("cpu"),
            fsdp=dims.needs_fsdp,
            fsdp_backend=(
                str(torch.distributed.get_backend(mesh.view("fsdp").get_group())) if dims.needs_fsdp else None
            ),
        )
    activation_applied = None
    num_layers = 0
    if activation is not None and activation.active:
        from meshforge.memory.names import decoder_layers

        num_layers = len(decoder_layers(model))
    if dims.pp > 1:
        from meshforge.parallel.pipeline import split_model

        split = split_model(
            model,
            pp_rank=mesh.view("pp").get_local_rank(),
            pp_size=dims.pp,
            layers_per_stage=par.pipeline_parallel_layers_per_stage,
            interleave=par.pipeline_parallel_interleave_num,
            schedule=par.pipeline_parallel_schedule,
            family=family,
        )
        model = split.model
    if dims.tp > 1:
        from meshforge.parallel.tensor import apply_tp

        apply_tp(
            model,
            mesh.view("tp"),
            family=family,
            # sequence_parallel follows TP (MindFormers document; see parallel/config.py).
            sequence_parallel=True,
            loss_parallel=par.enable_loss_parallel,
            colwise=list(par.tp_colwise),
            rowwise=list(par.tp_rowwise),
        )
    if dims.ep > 1:
        from meshforge.parallel.expert import apply_ep

        ep_modules = None if list(par.ep_modules) == MS_EP_MODULES else list(par.ep_modules)
        if list(par.ep_fsdp_modules) != list(par.ep_modules):
            # Experts sharded over EP must be their own FSDP units on the efsdp mesh (the dense
            # mesh cannot shard a tensor that EP already split over the same data ranks).
            raise NotImplementedError(
                "not supported yet: parallelism.ep_fsdp_modules different from parallelism.ep_modules "
                f"({list(par.ep_fsdp_modules)} vs {list(par.ep_modules)}); every expert-parallel "
                "container is an expert-FSDP unit"
            )
        apply_ep(
            model,
            mesh.view("ep"),
            token_dispatcher=par.moe_token_dispatcher_type,
            dispatcher=par.ep_dispatcher,
            modules=ep_modules,
            family=family,
        )
    if dims.cp > 1:
        from meshforge.parallel.context import apply_cp

        apply_cp(
            model,
            mesh.view("cp"),
            method=par.cp_method(),
            ulysses_degree=par.ulysses_degree_in_cp,
            family=family,
        )
        if family.moe is not None and family.moe.aux_reduce is not None:
            # The router aux loss is a product of sums over the whole sequence: sum over the CP ranks.
            family.moe.aux_reduce(model, mesh.view("cp"))
    lora_applied = None
    if lora is not None:
        from meshforge.lora.apply import apply_lora

        lora_applied = apply_lora(
            model,
            lora,
            adapter_dtype=param_dtype,
            frozen_dtype=compute_dtype if compute_dtype != param_dtype else None,
        )
    if activation is not None and activation.active:
        from meshforge.memory.apply import apply_activation_memory
        from meshforge.parallel.tensor import sequence_shards

        activation_applied = apply_activation_memory(
            model,
            activation,
            num_layers=num_layers,
            tp_mesh=mesh.view("tp") if dims.tp > 1 else None,
            sequence_parallel=sequence_shards(model) > 1,
        )
    if par.enable_chunk_batch:
        from meshforge.parallel.chunk_batch import apply_chunk_batch

        apply_chunk_batch(
            model,
            chunks=par.chunk_mbs,
            modules=list(par.chunk_mbs_modules),
            batch_dim=par.chunk_mbs_batch_dim,
            arg_indices=[int(i) for i in par.chunk_mbs_arg_indexs],
            kwarg_names=list(par.chunk_mbs_kwarg_names),
        )
    if compile_blocks and apply_compile is not None:
        # Compile before fully_shard: FSDP's hooks stay outside the compiled graphs.
        apply_compile(model)
    fsdp = dims.needs_fsdp
    if fsdp:
        from meshforge.parallel.fsdp import apply_fsdp, apply_fsdp_patterns

        kwargs: _FsdpOptions = {
            "param_dtype": compute_dtype if compute_dtype != param_dtype else None,
            "reduce_dtype": reduce_dtype
            if reduce_dtype is not None
            else parse_dtype(par.reduce_dtype, key="parallelism.reduce_dtype"),
            "reshard_policy": par.reshard_after_forward_policy,
            "ignored_modules": list(par.ignored_modules) if par.ignored_modules else None,
            "shard_placement": par.shard_placement_fn,
            "hook_modules": None if list(par.hook_modules) == MS_LAYER_MODULES else list(par.hook_modules),
        }
        # Parameters of a CPU run already live in host memory; offloading is for accelerators
        # (CPUOffloadPolicy moves them to the device for compute, which a CPU run has not).
        cpu_offload = par.cpu_offload and mesh.view("fsdp").device_type != "cpu"
        # A family without per-layer units still takes them under expert parallelism: they give
        # the sharded experts their own units on the expert mesh.
        pattern_units = not family.fsdp_layer_units and dims.ep == 1
        if pattern_units or _custom_units(par.fsdp_modules):
            # Module trees that vary (the transformers path), or a user who wants other units
            # than one per decoder layer: place units by the parallelism.fsdp_modules patterns.
            if dims.ep > 1:
                raise NotImplementedError(
                    "not supported yet: custom parallelism.fsdp_modules together with expert_parallel > 1 "
                    "(experts need their own FSDP units on the expert mesh)"
                )
            apply_fsdp_patterns(
                model,
                mesh.view("fsdp"),
                fsdp_modules=list(par.fsdp_modules),
                pipeline_parallel=dims.pp > 1,
                cpu_offload=cpu_offload,
                forward_prefetch=par.num_to_forward_prefetch,
                backward_prefetch=par.num_to_backward_prefetch,
                **kwargs,
            )
        else:
            apply_fsdp(
                model,
                mesh.view("fsdp"),
                expert_mesh=mesh.view("efsdp") if dims.ep > 1 else None,
                pipeline_parallel=dims.pp > 1,
                cpu_offload=cpu_offload,
                forward_prefetch=par.num_to_forward_prefetch,
                backward_prefetch=par.num_to_backward_prefetch,
                expert_placement=par.efsdp_shard_placement_fn,
                **kwargs,
            )
    return ParallelizedModel(
        model=model,
        pipeline_split=split,
        fsdp=fsdp,
        activation=activation_applied,
        lora=lora_applied,
        quant=quant_plan,
    )


def _custom_units(patterns: list[str]) -> bool:
    """Whether `fsdp_modules` asks for other units than one per decoder layer (plus the root)."""
    from meshforge.parallel.config import MS_FSDP_MODULES, MS_LAYER_MODULES

    return list(patterns) not in (MS_FSDP_MODULES, MS_LAYER_MODULES)
