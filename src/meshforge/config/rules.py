"""Cross-section rules: checks that need more than one section (light; no file or data access).

`cross_section_issues` runs at every load. `layer_issues` runs when the model's layer count is
known (from `model.num_hidden_layers`, or a config.json read by `config validate`/`check_trainable`).
Each returns (key path, reason) pairs; the caller decides whether they are errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshforge.config.layer_spec import LayerRange, check_layer_specs, expand_layers, parse_layer_spec
from meshforge.data.config import SFT_LOADER

if TYPE_CHECKING:
    from meshforge.config.root import TrainConfig
    from meshforge.memory.config import LayerSwapItem, OpSwapItem

Issue = tuple[str, str]


def _family(cfg: TrainConfig) -> str:
    model = cfg.model
    return str(model.model_id or model.model_type or "")


def cross_section_issues(cfg: TrainConfig) -> list[Issue]:
    """Rules that combine sections and need neither the model code nor any file."""
    issues: list[Issue] = []
    training, par, data = cfg.training, cfg.parallelism, cfg.train_dataset

    source = data.seq_length_source()
    if cfg.model.seq_length is not None and source is not None and cfg.model.seq_length != source[0]:
        data_seq, data_key = source
        issues.append(
            (
                "model.seq_length",
                f"{cfg.model.seq_length} differs from the data's sequence length {data_seq} "
                f"({data_key}); the data's value rules: remove model.seq_length or make them equal",
            )
        )

    loader = data.dataloader.type
    chat = training.stage in ("sft", "dpo", "rm")
    if "stage" in training.model_fields_set and loader and chat != (loader == SFT_LOADER):
        wanted = f"{SFT_LOADER}" if chat else f"a pretraining loader, not {SFT_LOADER}"
        issues.append(
            (
                "training.stage",
                f"{training.stage!r} trains on {'chat/instruction' if chat else 'raw-text'} "
                f"data: train_dataset.dataloader.type must be {wanted} (got {loader}); as in MindSpeed, sft "
                "pairs with LLaMA-Factory-style data and pt with pretraining data",
            )
        )

    alias = cfg.model.use_flash_attention
    if (
        alias is not None
        and "use_flash_attn" in cfg.kernels.model_fields_set
        and alias != cfg.kernels.use_flash_attn
    ):
        issues.append(
            (
                "model.use_flash_attention",
                f"{str(alias).lower()} contradicts kernels.use_flash_attn ({str(cfg.kernels.use_flash_attn).lower()}); it is an alias, set one of them",
            )
        )

    data = cfg.train_dataset
    if data.data_shared_file_system and data.no_shared_storage:
        issues.append(
            (
                "train_dataset.no_shared_storage",
                "true contradicts train_dataset.data_shared_file_system: true; data is prepared once per "
                "job on a shared file system, or once per node without one: set one of them",
            )
        )

    param_dtype = cfg.parallelism.param_dtype
    if param_dtype is not None:
        if param_dtype != cfg.model.compute_dtype:
            issues.append(
                (
                    "parallelism.param_dtype",
                    f"{param_dtype} contradicts model.compute_dtype ({cfg.model.compute_dtype}); it is the "
                    "MindSpeed spelling of the dtype FSDP computes in, set one of them",
                )
            )

    if training.global_batch_size is not None and training.local_batch_size > training.global_batch_size:
        issues.append(
            (
                "training.global_batch_size",
                f"{training.global_batch_size} is smaller than training.local_batch_size ({training.local_batch_size}); "
                "it must be at least data-parallel size x local_batch_size",
            )
        )

    if data.reset_attention_mask and training.local_batch_size != 1:
        issues.append(
            (
                "train_dataset.reset_attention_mask",
                f"requires training.local_batch_size == 1, got {training.local_batch_size}",
            )
        )

    # Megatron data brings its validation part through `split` (checked when the data is built).
    megatron = data.dataloader.type == "BlendedMegatronDatasetDataLoader"
    if (
        training.eval_interval is not None
        and not megatron
        and data.eval_dataset is None
        and data.val_size <= 1e-6
    ):
        issues.append(
            (
                "training.eval_interval",
                "needs evaluation data: set train_dataset.eval_dataset or train_dataset.val_size "
                "(Megatron data: a split with a validation part, e.g. '98,2,0')",
            )
        )

    prof = cfg.profiler
    if prof.enable_profiling and prof.start_step > training.steps:
        issues.append(
            (
                "profiler.start_step",
                f"{prof.start_step} is after the last step (training.steps = {training.steps})",
            )
        )

    issues += recompute_issues(cfg)

    issues += _swap_recompute_issues(cfg)

    family = _family(cfg)
    if par.context_parallel > 1:
        issues.extend(_cp_family_issues(cfg))
    for switch in ("use_ascend_mhc", "use_triton_swiglu_limit"):
        if getattr(cfg.kernels, switch) and family != "deepseek_v4":
            issues.append(
                (
                    f"kernels.{switch}",
                    f"only available for deepseek_v4 models, not {family or 'an unset model'}",
                )
            )

    stage_spec = par.pipeline_parallel_layers_per_stage
    if (
        par.pipeline_parallel > 1
        and isinstance(stage_spec, list)
        and len(stage_spec) != par.pipeline_parallel
    ):
        issues.append(
            (
                "parallelism.pipeline_parallel_layers_per_stage",
                f"has {len(stage_spec)} entries; needs one per pipeline stage ({par.pipeline_parallel})",
            )
        )
    if isinstance(stage_spec, str) and stage_spec != "auto":
        issues.append(
            ("parallelism.pipeline_parallel_layers_per_stage", f"a string must be 'auto', got {stage_spec!r}")
        )
    stage_strings = _stage_strings(stage_spec)
    if stage_strings is not None:
        issues.extend(_stage_string_issues(stage_strings, par.pipeline_parallel_interleave_num))

    if par.context_parallel > 1 and source is not None:
        data_seq, data_key = source
        # The ring layouts (colossal, hybrid) cut each row into 2 * cp chunks for causal load
        # balance; ulysses and kvallgather into cp contiguous slices.
        chunks = par.context_parallel * (2 if par.cp_method() in ("colossal", "hybrid") else 1)
        if data_seq % chunks:
            issues.append(
                (
                    "parallelism.context_parallel",
                    f"{par.context_parallel} ({par.cp_method()}) cuts each sequence into {chunks} equal parts, "
                    f"but the data's sequence length {data_seq} ({data_key}) is not a multiple of {chunks}",
                )
            )

    issues.extend(_quant_issues(cfg))
    issues.extend(_fault_tolerance_issues(cfg))
    num_layers = cfg.model.num_hidden_layers()
    if num_layers is not None:
        issues.extend(layer_issues(cfg, num_layers))
    return issues


def _fault_tolerance_issues(cfg: TrainConfig) -> list[Issue]:
    """Training options that do not combine with torchft replica groups (`train/replicas.py`)."""
    if not cfg.parallelism.fault_tolerance.enable:
        return []
    issues: list[Issue] = []
    if cfg.training.rampup_batch_size:
        issues.append(
            (
                "training.rampup_batch_size",
                "a batch ramp does not combine with parallelism.fault_tolerance.enable (replica groups "
                "share one fixed per-group batch)",
            )
        )
    if not cfg.parallelism.disable_gradient_division:
        issues.append(
            (
                "parallelism.disable_gradient_division",
                "false (a mean per data rank) does not combine with parallelism.fault_tolerance.enable: "
                "replica groups divide by the valid tokens of every live group (true)",
            )
        )
    return issues


def _cp_family_issues(cfg: TrainConfig) -> list[Issue]:
    """CP methods the config's family refuses, as its spec says (``FamilySpec.cp_refused``).

    Only a family the ``model:`` section names is known here; one found in a ``config.json``
    is refused by ``apply_cp`` with the same reason.
    """
    from meshforge.models.registry import find_family

    model = cfg.model
    spec = find_family(model.model_type, model.architectures, model.model_id)
    refused = spec.cp_refused(cfg.parallelism.cp_method()) if spec is not None else None
    if spec is None or refused is None:
        return []
    key, why = refused
    return [(key, f"not supported yet: context_parallel > 1 for {spec.name}: {why}")]


def _quant_issues(cfg: TrainConfig) -> list[Issue]:
    """`model.quant_*` keys that cannot work together (`parallel/float8.py`), before any model."""
    from meshforge.parallel.float8 import quant_settings

    try:
        quant_settings(cfg.model)
    except ValueError as err:
        text = str(err)
        if text.startswith("not supported yet: "):
            return [("model.quant_converters", text)]
        path, _, reason = text.partition(": ")
        return [(path, reason)]
    return []


def _stage_strings(spec: object) -> list[str] | None:
    """The per-rank stage strings of `pipeline_parallel_layers_per_stage`, or None for another form."""
    if isinstance(spec, list) and all(isinstance(item, str) for item in spec):
        return [str(item) for item in spec]
    return None


def stage_chunks(spec: list[str]) -> list[list[LayerRange]]:
    """Parse per-rank PP stage strings (`'0-3,8-11'`): one list of layer ranges (chunks) per rank."""
    return [[parse_layer_spec(chunk) for chunk in item.split(",")] for item in spec]


def _stage_string_issues(spec: list[str], interleave: int) -> list[Issue]:
    path = "parallelism.pipeline_parallel_layers_per_stage"
    issues: list[Issue] = []
    for rank, item in enumerate(spec):
        chunks = [c for c in item.split(",")]
        if len(chunks) != interleave:
            issues.append(
                (
                    f"{path}[{rank}]",
                    f"has {len(chunks)} chunk(s); needs pipeline_parallel_interleave_num = {interleave}",
                )
            )
        for chunk in chunks:
            try:
                parse_layer_spec(chunk)
            except ValueError as exc:  # PydanticCustomError is a ValueError
                issues.append((f"{path}[{rank}]", str(exc)))
    return issues


def _stage_layer_issues(spec: list[str], num_layers: int) -> list[Issue]:
    """Chunk c of rank r is virtual stage c * pp + r; the stages in order must tile [0, N-1] exactly."""
    path = "parallelism.pipeline_parallel_layers_per_stage"
    try:
        per_rank = stage_chunks(spec)
    except ValueError:
        return []  # reported by _stage_string_issues
    pp = len(per_rank)
    stages: dict[int, LayerRange] = {}
    for rank, chunks in enumerate(per_rank):
        for c, chunk in enumerate(chunks):
            stages[c * pp + rank] = chunk
    expected = 0
    for virtual in sorted(stages):
        chunk = stages[virtual]
        if chunk.lo != expected:
            return [
                (
                    path,
                    f"virtual stage {virtual} starts at layer {chunk.lo}, expected {expected}: stages must cover "
                    f"layers 0..{num_layers - 1} in order without gaps or overlaps",
                )
            ]
        expected = chunk.hi + 1
    if expected != num_layers:
        return [(path, f"stages cover layers 0..{expected - 1}; the model has {num_layers} layers")]
    return []


def _swap_recompute_issues(cfg: TrainConfig) -> list[Issue]:
    """A layer cannot be both swapped and recomputed whole (see `meshforge.memory.swap`)."""
    swap, rec = cfg.swap, cfg.recompute
    if not swap.enable or rec.mode == "None":
        return []
    issues: list[Issue] = []
    if rec.mode == "select":
        # The same module both recomputed and swapped: the swap hooks would hide its tensors
        # from the checkpoint around it (modules nested under each other are not resolvable here).
        for i, op in enumerate(swap.op_swap or []):
            selected = (rec.select_module or {}).get(op.op_name)
            both = sorted(set(expand_layers(selected)) & set(expand_layers(op.layers)))
            if both:
                issues.append(
                    (
                        f"swap.op_swap[{i}].op_name",
                        f"{op.op_name!r} in layer {both[0]} is also in recompute.select_module: a module "
                        "is either recomputed or swapped; choose one of the two for each layer",
                    )
                )
        return issues
    full = set(expand_layers(rec.full_recompute_layer))
    entries: list[tuple[str, LayerSwapItem | OpSwapItem]] = [
        *((f"swap.layer_swap[{i}].layers", item) for i, item in enumerate(swap.layer_swap or [])),
        *((f"swap.op_swap[{i}].layers", item) for i, item in enumerate(swap.op_swap or [])),
    ]
    for path, item in entries:
        both = sorted(full & set(expand_layers(item.layers)))
        if both:
            issues.append(
                (
                    path,
                    f"layer {both[0]} is also in recompute.full_recompute_layer: a fully recomputed layer "
                    "keeps only its inputs, so its activations cannot also be swapped; "
                    "choose one of the two for each layer",
                )
            )
    return issues


# Pipeline schedules (as written, case/`_`/`-` ignored) that split backward into input and weights.
_SPLIT_BACKWARD_SCHEDULES = frozenset({"interleavedzerobubble", "zerobubble", "zb", "zbv", "zbvzerobubble"})


def recompute_issues(cfg: TrainConfig) -> list[Issue]:
    """`recompute` / `recompute_comm` keys that would change nothing, overlap, or name no operator."""
    from meshforge.memory.ops import OP_ALIASES, is_operator_name

    issues: list[Issue] = []
    rec, comm = cfg.recompute, cfg.recompute_comm
    if rec.modules and rec.mode != "full":
        issues.append(
            (
                "recompute.modules",
                f"module patterns are recomputed whole: needs recompute.mode 'full', got '{rec.mode}'",
            )
        )
    if rec.mode == "None":
        for key in ("full_recompute_layer", "select_module", "exclude_op"):
            if getattr(rec, key):
                issues.append(
                    (
                        f"recompute.{key}",
                        "has no effect with recompute.mode 'None'; set mode 'full' or 'select'",
                    )
                )
    for i, op in enumerate(rec.exclude_op or []):
        if not is_operator_name(op):
            issues.append(
                (
                    f"recompute.exclude_op[{i}]",
                    f"{op!r} is not an operator name: write 'aten.mm', 'mm', 'aten.mm.default' or one of "
                    f"{', '.join(sorted(OP_ALIASES))}, optionally followed by /N (keep one call in N)",
                )
            )
    par = cfg.parallelism
    schedule = str(par.pipeline_parallel_schedule).lower().replace("_", "").replace("-", "")
    split = schedule in _SPLIT_BACKWARD_SCHEDULES or par.pipeline_parallel_enable_dxdw_split
    if rec.exclude_op and rec.mode != "None" and par.pipeline_parallel > 1 and split:
        issues.append(
            (
                "recompute.exclude_op",
                "kept operators use PyTorch's selective checkpoint, which allows one backward per "
                "region; the zero-bubble split backward (input, then weights) runs two: recompute "
                "without exclude_op, or use a 1f1b/interleaved schedule",
            )
        )
    full = set(expand_layers(rec.full_recompute_layer or []))
    for key, specs in (rec.select_module or {}).items():
        both = sorted(full & set(expand_layers(specs)))
        if both:
            issues.append(
                (
                    f"recompute.select_module.{key}",
                    f"layer {both[0]} is also in recompute.full_recompute_layer; a layer is recomputed "
                    "whole or by module, not both",
                )
            )
    if comm.select_module and not comm.enable:
        issues.append(("recompute_comm.select_module", "has no effect without recompute_comm.enable: true"))
    return issues


def layer_issues(cfg: TrainConfig, num_layers: int) -> list[Issue]:
    """Layer specs, swap prefetch and PP stage split checked against `num_layers` decoder layers."""
    issues: list[Issue] = []
    rec, comm, swap = cfg.recompute, cfg.recompute_comm, cfg.swap
    issues += check_layer_specs(rec.full_recompute_layer, num_layers, "recompute.full_recompute_layer")
    for key, specs in (rec.select_module or {}).items():
        issues += check_layer_specs(specs, num_layers, f"recompute.select_module.{key}")
    for key, specs in (comm.select_module or {}).items():
        issues += check_layer_specs(specs, num_layers, f"recompute_comm.select_module.{key}")
    if cfg.lora_config is not None:
        issues += check_layer_specs(cfg.lora_config.exclude_layers, num_layers, "lora_config.exclude_layers")
    swap_lists: tuple[tuple[str, Sequence[LayerSwapItem | OpSwapItem] | None], ...] = (
        ("layer_swap", swap.layer_swap),
        ("op_swap", swap.op_swap),
    )
    for name, items in swap_lists:
        for i, item in enumerate(items or []):
            path = f"swap.{name}[{i}].layers"
            found = check_layer_specs(item.layers, num_layers, path)
            issues += found
            top = max(expand_layers(item.layers), default=-1)
            if swap.enable and not found and top + swap.default_prefetch >= num_layers:
                issues.append(
                    (
                        path,
                        f"last layer {top} + swap.default_prefetch {swap.default_prefetch} must be < {num_layers} layers",
                    )
                )
    if swap.enable and not 1 <= swap.default_prefetch <= num_layers - 1:
        issues.append(
            (
                "swap.default_prefetch",
                f"must be in [1, {num_layers - 1}] for {num_layers} layers, got {swap.default_prefetch}",
            )
        )
    targets = cfg.monitor.moe_monitor.target_layers
    if isinstance(targets, list):
        for i, layer in enumerate(targets):
            if layer >= num_layers:
                issues.append(
                    (
                        f"monitor.moe_monitor.target_layers[{i}]",
                        f"layer {layer} is out of range [0, {num_layers - 1}]",
                    )
                )
    elif isinstance(targets, int) and targets > num_layers:
        issues.append(
            ("monitor.moe_monitor.target_layers", f"{targets} is more than the model's {num_layers} layers")
        )
    par = cfg.parallelism
    stage_spec = par.pipeline_parallel_layers_per_stage
    stage_strings = _stage_strings(stage_spec)
    if stage_strings:
        issues.extend(_stage_layer_issues(stage_strings, num_layers))
    chunks = par.pipeline_parallel * par.pipeline_parallel_interleave_num
    if par.pipeline_parallel > 1 and par.pipeline_parallel_layers_per_stage == "auto" and num_layers % chunks:
        issues.append(
            (
                "parallelism.pipeline_parallel_layers_per_stage",
                f"'auto' needs num_hidden_layers ({num_layers}) divisible by pipeline_parallel x interleave ({chunks})",
            )
        )
    return issues
