"""`parallelism:` section: FSDP/HSDP, TP/SP, CP, PP and EP degrees and their options (light).

Fields and defaults follow the MindFormers ParallelismConfig (its PyNative training config); the MindSpeed-LLM
ParallelArguments get native homes here (module patterns, FSDP prefetch, EP dispatcher, mixed
precision dtypes, chunked micro-batches). `sequence_parallel` follows tensor parallelism
automatically, as the MindFormers document says; its code's error for tp > 1 without it is
deliberately not reproduced. Degree products against a world size are checked by `ParallelDims`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from meshforge.config.base import (
    AtLeastOne,
    Bool,
    DtypeName,
    Int,
    PosFloat,
    PosInt,
    StrictSection,
    describe,
    rule_error,
)

MS_FSDP_MODULES = ["model.layers.{*}", "model.embed_tokens", "lm_head"]
MS_TP_COLWISE = ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"]
MS_TP_ROWWISE = ["*.o_proj", "*.down_proj"]
MS_EP_MODULES = ["model.layers.{*}.mlp.experts"]
MS_LAYER_MODULES = ["model.layers.{*}"]
MS_CHUNK_KWARGS = ["position_embeddings", "position_ids", "attention_mask", "input_ids"]


def normalize_pattern(pattern: str) -> str:
    """`{}` (MindSpeed's documented default) means `{*}`: any layer number."""
    return pattern.replace("{}", "{*}")


def _normalize_patterns(value: object) -> object:
    if isinstance(value, list):
        return [normalize_pattern(v) if isinstance(v, str) else v for v in value]
    return value


class FaultToleranceConfig(StrictSection):
    """`parallelism.fault_tolerance:` replica groups over torchft (`train/replicas.py`, docs/torchft.md).

    Each replica group is a job of its own (its own torchrun world, FSDP inside it); the groups
    average their gradients through torchft's managed all-reduce, a failed group leaves the quorum
    and a restarted one copies the live state from a peer.
    """

    enable: Bool = describe(
        False, "Train as one torchft replica group among parallelism.fault_tolerance.replica_groups."
    )
    replica_groups: PosInt = describe(
        2,
        "Replica groups the data is sharded over (each one job); the quorum may hold fewer while one is down.",
    )
    replica_id: Int | None = describe(
        None, "This group's index in [0, replica_groups); null = env REPLICA_GROUP_ID or TORCHFT_REPLICA_ID."
    )
    min_replicas: PosInt = describe(
        1, "Replica groups a step needs to commit (the lighthouse's quorum minimum)."
    )
    lighthouse: str | None = describe(
        None, "Lighthouse address (http://host:port); null = env TORCHFT_LIGHTHOUSE."
    )
    timeout_s: PosFloat = describe(
        60.0,
        "Seconds a cross-group collective, commit vote or recovery transfer may take before the step is dropped (and connecting to the lighthouse).",
    )
    quorum_timeout_s: PosFloat = describe(60.0, "Seconds to wait for a quorum at the start of a step.")

    @model_validator(mode="after")
    def _rules(self) -> FaultToleranceConfig:
        if self.replica_id is not None and not 0 <= self.replica_id < self.replica_groups:
            raise rule_error(
                "replica_id", f"must be in [0, replica_groups={self.replica_groups}), got {self.replica_id}"
            )
        if self.min_replicas > self.replica_groups:
            raise rule_error(
                "min_replicas", f"({self.min_replicas}) cannot exceed replica_groups ({self.replica_groups})"
            )
        return self


# Degrees that do not combine with replica groups: name -> why (checked when enabled).
FT_REFUSED_DEGREES = {
    "pipeline_parallel": "a pipeline stage's gradients would need a managed all-reduce per stage",
    "tensor_parallel": "not tested with DTensor-sharded TP gradients across replica groups",
    "context_parallel": "not tested with CP across replica groups",
    "expert_parallel": "expert shards are not tested across replica groups",
}


class ParallelismConfig(StrictSection):
    """Parallel layout of the run."""

    data_parallel_shard: Int = describe(
        -1, "FSDP shard group size; -1 = all ranks left after the other degrees (pure FSDP)."
    )
    data_parallel_shard_strategy: Literal["optim_grads_params", "optim_grads", "optim"] = describe(
        "optim_grads_params",
        "What FSDP shards: optim_grads_params (ZeRO-3); optim_grads (ZeRO-2: weights kept gathered from forward to backward).",
    )
    reshard_after_forward_policy: Literal["always", "never", "default"] = describe(
        "default", "Free gathered parameters after forward: always, never, or default (not under PP)."
    )
    reshard_after_forward: Bool | None = describe(
        None, "MindSpeed alias: true = policy always, false = never; must agree with an explicit policy."
    )
    cpu_offload: Bool = describe(False, "Offload FSDP parameters, gradients and optimizer state to CPU.")
    disable_gradient_division: Bool = describe(
        True,
        "true: gradient of the global token mean (FSDP sums); false: mean over data ranks of each rank's token mean.",
    )
    dense_fsdp_shard_size: PosInt | None = describe(
        None,
        "Ranks sharding each dense (non-expert) weight, the rest replicate (HSDP); null = data_parallel_shard x context_parallel.",
    )
    tensor_parallel: PosInt = describe(1, "Tensor-parallel degree (sequence parallel follows it).")
    context_parallel: PosInt = describe(1, "Context-parallel degree (sequence split across ranks).")
    context_parallel_method: Literal["colossal", "ulysses", "hybrid", "ring", "kvallgather"] = describe(
        "colossal",
        "CP algorithm: colossal (ring attention; `ring` is an alias), ulysses, hybrid, kvallgather.",
    )
    context_parallel_async: Bool = describe(False, "Asynchronous CP communication hooks.")
    ulysses_degree_in_cp: PosInt | None = describe(None, "Ulysses degree inside CP; required for hybrid CP.")
    context_parallel_mask_type: Literal["causal"] = describe(
        "causal", "Attention mask type supported by the CP path."
    )
    pipeline_parallel: PosInt = describe(1, "Pipeline-parallel degree (number of stages).")
    pipeline_parallel_layers_per_stage: list[list[Int]] | list[str] | str | None = describe(
        "auto", "Layers per PP stage: 'auto' (even split) or one spec string per rank."
    )
    pipeline_parallel_schedule: str = describe(
        "1f1b", "PP schedule name (e.g. 1f1b, gpipe, interleaved1f1b)."
    )
    pipeline_parallel_microbatch_size: PosInt = describe(1, "Micro-batch size inside the PP schedule.")
    pipeline_parallel_interleave_num: PosInt = describe(
        1, "Model chunks per PP rank (interleaved schedules)."
    )
    pipeline_parallel_overlap_p2p: Bool = describe(False, "Overlap PP send/recv with compute.")
    pipeline_parallel_overlap_b_f: Bool = describe(
        False, "Overlap backward and forward of adjacent micro-batches."
    )
    pipeline_parallel_enable_dxdw_split: Bool = describe(
        False, "Split input-grad and weight-grad passes in PP."
    )
    pipeline_parallel_p2p_transport: str = describe("plain", "Transport used for PP point-to-point messages.")
    sequence_parallel: Bool = describe(
        False, "Informational: sequence parallelism is on whenever tensor_parallel > 1."
    )
    enable_mc2: Bool = describe(False, "Fuse TP matmul with communication (Ascend MC2).")
    enable_loss_parallel: Bool = describe(
        False, "Compute the loss on vocab-sharded logits (TP loss parallel)."
    )
    expert_parallel: PosInt = describe(1, "Expert-parallel degree for MoE layers.")
    npu_nums_per_device: PosInt = describe(8, "Accelerator ranks per node (Ascend alltoall_deredundancy).")
    moe_token_dispatcher_type: Literal["alltoall", "alltoall_deredundancy"] = describe(
        "alltoall",
        "MoE token dispatch: alltoall, or alltoall_deredundancy (needs expert_parallel >= npu_nums_per_device).",
    )
    expert_parallel_async_d2h: Bool = describe(False, "Copy expert token counts to host asynchronously.")
    expert_parallel_use_safe_tokens: Bool = describe(True, "Guard against empty experts in EP dispatch.")
    # MindSpeed-LLM ParallelArguments homes.
    ep_fsdp_size: PosInt | None = describe(
        None,
        "Ranks sharding each expert's weights (MindSpeed ep_fsdp_size); null = all data-shard ranks outside the EP group.",
    )
    fsdp_modules: list[str] = describe(
        list(MS_FSDP_MODULES), "Module patterns wrapped by FSDP; must be non-empty."
    )
    ignored_modules: list[str] | None = describe(
        None, "Module patterns whose parameters FSDP does not shard."
    )
    shard_placement_fn: str | None = describe(None, "Custom FSDP shard placement function for dense modules.")
    efsdp_shard_placement_fn: Literal["shard_by_dim_0", "shard_by_dim_1"] = describe(
        "shard_by_dim_1", "Shard placement of expert weights under expert FSDP."
    )
    hook_modules: list[str] = describe(
        list(MS_LAYER_MODULES), "Module patterns that get FSDP prefetch hooks."
    )
    fsdp_implementation: Literal["native"] = describe("native", "FSDP implementation: PyTorch's fully_shard.")
    tp_colwise: list[str] = describe(list(MS_TP_COLWISE), "Module patterns split column-wise under TP.")
    tp_rowwise: list[str] = describe(list(MS_TP_ROWWISE), "Module patterns split row-wise under TP.")
    ep_modules: list[str] = describe(list(MS_EP_MODULES), "Expert containers distributed over EP.")
    ep_fsdp_modules: list[str] = describe(list(MS_EP_MODULES), "Expert containers sharded by expert FSDP.")
    ep_dispatcher: Literal["eager", "fused", "mc2"] = describe(
        "eager", "Expert-parallel all-to-all dispatcher."
    )
    param_dtype: DtypeName | None = describe(
        None,
        "MindSpeed alias of model.compute_dtype (the dtype FSDP computes in); must agree when both are set.",
    )
    reduce_dtype: DtypeName = describe(
        "float32", "FSDP gradient reduce dtype (float32, bfloat16, float16; aliases fp32, bf16, fp16)."
    )
    num_to_forward_prefetch: Int = describe(1, "Modules prefetched ahead in forward.")
    num_to_backward_prefetch: Int = describe(1, "Modules prefetched ahead in backward.")
    enable_chunk_batch: Bool = describe(
        False, "Split each micro-batch into chunks through the layers (MindSpeed)."
    )
    chunk_mbs: AtLeastOne = describe(1, "Number of chunks per micro-batch when enable_chunk_batch.")
    chunk_mbs_batch_dim: Int = describe(0, "Batch dimension split by chunking.")
    chunk_mbs_modules: list[str] = describe(list(MS_LAYER_MODULES), "Module patterns run chunk by chunk.")
    chunk_mbs_arg_indexs: list[Int] = describe([0], "Positional argument indices chunked.")
    chunk_mbs_kwarg_names: list[str] = describe(list(MS_CHUNK_KWARGS), "Keyword arguments chunked.")
    fault_tolerance: FaultToleranceConfig = describe(
        FaultToleranceConfig(), "Replica-level fault tolerance with torchft (docs/torchft.md)."
    )

    _normalize = field_validator(
        "fsdp_modules",
        "ignored_modules",
        "hook_modules",
        "tp_colwise",
        "tp_rowwise",
        "ep_modules",
        "ep_fsdp_modules",
        "chunk_mbs_modules",
        mode="before",
    )(classmethod(lambda cls, v: _normalize_patterns(v)))

    @model_validator(mode="before")
    @classmethod
    def _reshard_alias(cls, data: object) -> object:
        # MindSpeed's boolean spelling sets the policy the FSDP code reads, unless a policy is written.
        if isinstance(data, dict) and isinstance(data.get("reshard_after_forward"), bool):
            if "reshard_after_forward_policy" not in data:
                policy = "always" if data["reshard_after_forward"] else "never"
                data = {**data, "reshard_after_forward_policy": policy}
        if (
            isinstance(data, dict)
            and data.get("data_parallel_shard_strategy") == "optim_grads"
            and "reshard_after_forward_policy" not in data
        ):
            # ZeRO-2 in FSDP2 terms (FSDP1's SHARD_GRAD_OP): gathered weights stay from forward
            # to backward; gradients and optimizer state are sharded.
            data = {**data, "reshard_after_forward_policy": "never"}
        return data

    @model_validator(mode="after")
    def _rules(self) -> ParallelismConfig:
        if self.data_parallel_shard == 0 or self.data_parallel_shard < -1:
            raise rule_error(
                "data_parallel_shard", f"must be -1 (all ranks) or positive, got {self.data_parallel_shard}"
            )
        if (
            self.moe_token_dispatcher_type == "alltoall_deredundancy"
            and self.expert_parallel < self.npu_nums_per_device
        ):
            raise rule_error(
                "moe_token_dispatcher_type",
                f"alltoall_deredundancy requires parallelism.expert_parallel ({self.expert_parallel}) >= "
                f"parallelism.npu_nums_per_device ({self.npu_nums_per_device})",
            )
        if not self.enable_chunk_batch:
            for name in (
                "chunk_mbs",
                "chunk_mbs_batch_dim",
                "chunk_mbs_modules",
                "chunk_mbs_arg_indexs",
                "chunk_mbs_kwarg_names",
            ):
                if (
                    name in self.model_fields_set
                    and getattr(self, name) != type(self).model_fields[name].default
                ):
                    raise rule_error(name, "has no effect unless parallelism.enable_chunk_batch: true")
        if not self.fsdp_modules:
            raise rule_error("fsdp_modules", "must list at least one module pattern")
        if self.fault_tolerance.enable:
            for name, why in FT_REFUSED_DEGREES.items():
                if getattr(self, name) > 1:
                    raise rule_error(
                        "fault_tolerance.enable",
                        f"does not combine with parallelism.{name}: {getattr(self, name)} ({why}); "
                        f"replica groups support FSDP inside each group only",
                    )
            if self.dense_fsdp_shard_size is not None:
                raise rule_error(
                    "fault_tolerance.enable",
                    "does not combine with parallelism.dense_fsdp_shard_size (HSDP inside a group): the "
                    "replicate dimension is the replica groups themselves",
                )
        if self.num_to_forward_prefetch < 0:
            raise rule_error("num_to_forward_prefetch", f"must be >= 0, got {self.num_to_forward_prefetch}")
        if self.num_to_backward_prefetch < 0:
            raise rule_error("num_to_backward_prefetch", f"must be >= 0, got {self.num_to_backward_prefetch}")
        method = self.cp_method()
        if (
            self.context_parallel > 1
            and method == "ulysses"
            and self.ulysses_degree_in_cp not in (None, self.context_parallel)
        ):
            raise rule_error(
                "ulysses_degree_in_cp",
                f"ulysses CP requires ulysses_degree_in_cp == context_parallel ({self.context_parallel}), got {self.ulysses_degree_in_cp}",
            )
        if self.context_parallel > 1 and method == "hybrid":
            u = self.ulysses_degree_in_cp
            if u is None or not (1 < u < self.context_parallel) or self.context_parallel % u:
                raise rule_error(
                    "ulysses_degree_in_cp",
                    f"hybrid CP requires 1 < ulysses_degree_in_cp < context_parallel ({self.context_parallel}) dividing it, got {u}",
                )
        if (
            self.data_parallel_shard_strategy == "optim_grads"
            and self.reshard_after_forward_policy == "always"
        ):
            raise rule_error(
                "data_parallel_shard_strategy",
                "optim_grads (ZeRO-2) keeps the gathered weights until backward; it contradicts "
                "reshard_after_forward_policy 'always'",
            )
        if self.reshard_after_forward is not None:
            wanted = "always" if self.reshard_after_forward else "never"
            if wanted != self.reshard_after_forward_policy:
                raise rule_error(
                    "reshard_after_forward",
                    f"{str(self.reshard_after_forward).lower()} contradicts reshard_after_forward_policy "
                    f"'{self.reshard_after_forward_policy}'; set only one of them",
                )
        return self

    def cp_method(self) -> str:
        """The CP algorithm with aliases resolved (`ring` -> `colossal`)."""
        return "colossal" if self.context_parallel_method == "ring" else self.context_parallel_method
