"""Bad configs: each must fail with a ConfigError naming the key path (and, where useful, the fix)."""

from __future__ import annotations

import textwrap

import pytest

from meshforge.config import ConfigError, load_config


def _error(tmp_path, text: str, overrides=(), fmt=None) -> ConfigError:
    path = tmp_path / "train.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, fmt=fmt)
    return info.value


# (id, yaml text, expected key path, expected words in the reason)
BAD = [
    ("wrong-type", "training:\n  steps: abc\n", "training.steps", "integer"),
    (
        "cp-ring-seq",
        "parallelism:\n  context_parallel: 2\ntrain_dataset:\n  dataloader:\n    type: TextDataLoader\n"
        "    seq_length: 6\n",
        "parallelism.context_parallel",
        "not a multiple of 4",
    ),
    ("unknown-key", "training:\n  stpes: 10\n", "training.stpes", "did you mean 'steps'"),
    ("unknown-top-level", "trainig:\n  steps: 10\n", "trainig", "did you mean 'training'"),
    (
        "unknown-nested",
        "monitor:\n  tensorboard:\n    outdir: x\n",
        "monitor.tensorboard.outdir",
        "output_dir",
    ),
    (
        "layer-spec-reversed",
        "recompute:\n  mode: full\n  full_recompute_layer: ['3-1']\n",
        "recompute.full_recompute_layer[0]",
        "greater than end",
    ),
    (
        "layer-spec-overlap",
        "recompute:\n  mode: full\n  full_recompute_layer: ['0-3', '2']\n",
        "recompute.full_recompute_layer",
        "ascending",
    ),
    (
        "layer-spec-garbage",
        "recompute:\n  mode: full\n  full_recompute_layer: ['first']\n",
        "recompute.full_recompute_layer[0]",
        "invalid layer spec",
    ),
    (
        "layer-spec-bool",
        "recompute:\n  mode: full\n  full_recompute_layer: [true]\n",
        "recompute.full_recompute_layer[0]",
        "layer spec",
    ),
    ("negative-local-batch", "training:\n  local_batch_size: -1\n", "training.local_batch_size", "positive"),
    ("zero-global-batch", "training:\n  global_batch_size: 0\n", "training.global_batch_size", "positive"),
    (
        "local-over-global",
        "training:\n  local_batch_size: 4\n  global_batch_size: 2\n",
        "training.global_batch_size",
        "local_batch_size",
    ),
    ("profiler-window", "profiler:\n  start_step: 5\n  end_step: 3\n", "profiler.end_step", "start_step"),
    ("profiler-zero-start", "profiler:\n  start_step: 0\n", "profiler.start_step", "positive"),
    (
        "profiler-level-null",
        "profiler:\n  profiler_level: null\n",
        "profiler.profiler_level",
        "cannot be null",
    ),
    ("profiler-level-bool", "profiler:\n  profiler_level: true\n", "profiler.profiler_level", "boolean"),
    (
        "gdn-exclusive",
        "kernels:\n  use_flash_gdn: true\n  use_triton_gdn: true\n",
        "kernels.use_flash_gdn",
        "mutually exclusive",
    ),
    ("section-not-mapping", "training: 5\n", "training", "must be a mapping"),
    ("bool-as-number", "training:\n  steps: true\n", "training.steps", "boolean is not a number"),
    ("bool-as-float", "optimizer:\n  eps: false\n", "optimizer.eps", "boolean is not a number"),
    ("int-as-bool", "checkpoint:\n  enable_save: 1\n", "checkpoint.enable_save", "true or false"),
    ("string-as-bool", "training:\n  deterministic: 'yes'\n", "training.deterministic", "true or false"),
    ("null-required", "training:\n  seed: null\n", "training.seed", "cannot be null"),
    ("betas-length", "optimizer:\n  betas: [0.9]\n", "optimizer.betas", "two values"),
    ("betas-range", "optimizer:\n  betas: [0.9, 1.0]\n", "optimizer.betas", "[0, 1)"),
    ("negative-lr", "lr_scheduler:\n  learning_rate: -1.0e-4\n", "lr_scheduler.learning_rate", ">= 0"),
    ("max-norm-zero", "training:\n  max_norm: 0\n", "training.max_norm", "positive"),
    ("negative-weight-decay", "optimizer:\n  weight_decay: -0.1\n", "optimizer.weight_decay", ">= 0"),
    (
        "blank-wd-pattern",
        "optimizer:\n  weight_decay_exclude: ['norm', ' ']\n",
        "optimizer.weight_decay_exclude",
        "blank",
    ),
    ("save-max-zero", "checkpoint:\n  save_max: 0\n", "checkpoint.save_max", ">= 1"),
    (
        "save-interval-zero",
        "checkpoint:\n  save_interleaved_steps: 0\n",
        "checkpoint.save_interleaved_steps",
        ">= 1",
    ),
    ("steps-zero", "training:\n  steps: 0\n", "training.steps", ">= 1"),
    (
        "dispatcher-vs-ep",
        "parallelism:\n  expert_parallel: 4\n  moe_token_dispatcher_type: alltoall_deredundancy\n",
        "parallelism.moe_token_dispatcher_type",
        "npu_nums_per_device",
    ),
    ("dp-shard-zero", "parallelism:\n  data_parallel_shard: 0\n", "parallelism.data_parallel_shard", "-1"),
    (
        "cp-method",
        "parallelism:\n  context_parallel_method: megatron\n",
        "parallelism.context_parallel_method",
        "colossal",
    ),
    (
        "hybrid-cp",
        "parallelism:\n  context_parallel: 4\n  context_parallel_method: hybrid\n",
        "parallelism.ulysses_degree_in_cp",
        "hybrid",
    ),
    (
        "reshard-conflict",
        "parallelism:\n  reshard_after_forward: true\n  reshard_after_forward_policy: never\n",
        "parallelism.reshard_after_forward",
        "contradicts",
    ),
    ("empty-fsdp-modules", "parallelism:\n  fsdp_modules: []\n", "parallelism.fsdp_modules", "at least one"),
    (
        "moe-interval-bool",
        "monitor:\n  moe_monitor:\n    save_tokens_per_expert_interval: true\n",
        "monitor.moe_monitor.save_tokens_per_expert_interval",
        "boolean",
    ),
    (
        "moe-interval-zero",
        "monitor:\n  moe_monitor:\n    save_tokens_per_expert_interval: 0\n",
        "monitor.moe_monitor.save_tokens_per_expert_interval",
        "> 0",
    ),
    (
        "moe-layers-zero",
        "monitor:\n  moe_monitor:\n    target_layers: 0\n",
        "monitor.moe_monitor.target_layers",
        "> 0",
    ),
    (
        "moe-layers-negative",
        "monitor:\n  moe_monitor:\n    target_layers: [0, -1]\n",
        "monitor.moe_monitor.target_layers",
        ">= 0",
    ),
    (
        "moe-layers-bool-list",
        "monitor:\n  moe_monitor:\n    target_layers: [true]\n",
        "monitor.moe_monitor.target_layers",
        "boolean",
    ),
    ("recompute-mode", "recompute:\n  mode: partial\n", "recompute.mode", "'None'"),
    ("recompute-mode-null", "recompute:\n  mode: null\n", "recompute.mode", "quote 'None'"),
    ("full-needs-layers", "recompute:\n  mode: full\n", "recompute.full_recompute_layer", "requires"),
    ("select-needs-module", "recompute:\n  mode: select\n", "recompute.select_module", "requires"),
    (
        "select-module-shape",
        "recompute:\n  mode: select\n  select_module: ['attention']\n",
        "recompute.select_module",
        "mapping",
    ),
    (
        "select-module-values",
        "recompute:\n  mode: select\n  select_module:\n    attention: '0-1'\n",
        "recompute.select_module",
        "list of layer specs",
    ),
    ("comm-needs-module", "recompute_comm:\n  enable: true\n", "recompute_comm.select_module", "requires"),
    ("exclude-op-blank", "recompute:\n  exclude_op: ['matmul', '']\n", "recompute.exclude_op", "blank"),
    (
        "swap-missing-layers",
        "swap:\n  enable: true\n  layer_swap:\n    - {}\n",
        "swap.layer_swap[0].layers",
        "missing",
    ),
    (
        "swap-missing-op-name",
        "swap:\n  enable: true\n  op_swap:\n    - layers: ['0']\n",
        "swap.op_swap[0].op_name",
        "missing",
    ),
    (
        "swap-layer-range",
        "model:\n  num_hidden_layers: 4\nswap:\n  enable: true\n  layer_swap:\n    - layers: ['0-5']\n",
        "swap.layer_swap[0].layers[0]",
        "out of range [0, 3]",
    ),
    (
        "swap-prefetch-range",
        "model:\n  num_hidden_layers: 4\nswap:\n  enable: true\n  default_prefetch: 4\n",
        "swap.default_prefetch",
        "[1, 3]",
    ),
    (
        "recompute-layer-range",
        "model:\n  num_hidden_layers: 4\nrecompute:\n  mode: full\n  full_recompute_layer: ['0-1', '7']\n",
        "recompute.full_recompute_layer[1]",
        "out of range [0, 3]",
    ),
    (
        "select-layer-range",
        "model:\n  num_hidden_layers: 2\nrecompute:\n  mode: select\n  select_module:\n    mlp: ['2']\n",
        "recompute.select_module.mlp[0]",
        "out of range [0, 1]",
    ),
    (
        "seq-length-mismatch",
        "model:\n  seq_length: 1024\ntrain_dataset:\n  dataloader:\n    type: TextDataLoader\n    seq_length: 2048\n",
        "model.seq_length",
        "train_dataset.dataloader.seq_length",
    ),
    (
        "seq-length-mismatch-megatron",
        "model:\n  seq_length: 1024\ntrain_dataset:\n  dataloader:\n    type: BlendedMegatronDatasetDataLoader\n"
        "    config:\n      seq_length: 4096\n",
        "model.seq_length",
        "train_dataset.dataloader.config.seq_length",
    ),
    (
        # The data's sequence length is read typed when the config loads: a bad value is an error
        # there even while the other loader options (data_path) are not given yet.
        "seq-length-bad-value",
        "train_dataset:\n  dataloader:\n    type: TextDataLoader\n    seq_length: abc\n",
        "train_dataset.dataloader.seq_length",
        "integer",
    ),
    (
        "seq-length-bad-megatron",
        "train_dataset:\n  dataloader:\n    type: BlendedMegatronDatasetDataLoader\n    config:\n"
        "      seq_length: true\n",
        "train_dataset.dataloader.config.seq_length",
        "integer",
    ),
    (
        "ga-and-gbs",
        "training:\n  gradient_accumulation_steps: 2\n  global_batch_size: 8\n",
        "training.gradient_accumulation_steps",
        "not both",
    ),
    (
        "rampup-shape",
        "training:\n  rampup_batch_size: [1, 2]\n",
        "training.rampup_batch_size",
        "three integers",
    ),
    (
        "rampup-bool",
        "training:\n  rampup_batch_size: [1, true, 3]\n",
        "training.rampup_batch_size",
        "three integers",
    ),
    ("context-mode", "context:\n  mode: 0\n", "context.mode", "only 1"),
    ("device-target", "context:\n  device_target: tpu\n", "context.device_target", "cuda"),
    ("compute-dtype", "model:\n  compute_dtype: int8\n", "model.compute_dtype", "bfloat16"),
    ("model-id", "model:\n  model_id: llama9\n", "model.model_id", "qwen3"),
    ("callback-type-missing", "callbacks:\n  - log_interval: 10\n", "callbacks[0].type", "missing"),
    ("callbacks-not-list", "callbacks: {type: X}\n", "callbacks", "list"),
    (
        "interleave-count",
        "train_dataset:\n  dataset: alpaca,sharegpt\n  mix_strategy: interleave_under\n  interleave_probs: '0.2,0.3,0.5'\n",
        "train_dataset.interleave_probs",
        "2 dataset(s)",
    ),
    (
        "interleave-with-concat",
        "train_dataset:\n  dataset: a,b\n  interleave_probs: '0.5,0.5'\n",
        "train_dataset.interleave_probs",
        "concat",
    ),
    (
        "history-vs-prompt",
        "train_dataset:\n  mask_history: true\n  train_on_prompt: true\n",
        "train_dataset.mask_history",
        "mutually exclusive",
    ),
    ("val-size-no-dataset", "train_dataset:\n  val_size: 0.1\n", "train_dataset.val_size", "dataset"),
    (
        "streaming-max-samples",
        "train_dataset:\n  streaming: true\n  max_samples: 10\n",
        "train_dataset.max_samples",
        "streaming",
    ),
    (
        "reset-needs-eod",
        "train_dataset:\n  reset_attention_mask: true\n",
        "train_dataset.reset_attention_mask",
        "append_eod",
    ),
    (
        "reset-needs-batch-1",
        "training:\n  local_batch_size: 2\n  global_batch_size: 2\ntrain_dataset:\n  reset_attention_mask: true\n  append_eod: true\n",
        "train_dataset.reset_attention_mask",
        "local_batch_size == 1",
    ),
    (
        "flash-alias-conflict",
        "model:\n  use_flash_attention: true\nkernels:\n  use_flash_attn: false\n",
        "model.use_flash_attention",
        "alias",
    ),
    (
        "zero2-contradicts-always",
        "parallelism:\n  data_parallel_shard_strategy: optim_grads\n  reshard_after_forward_policy: always\n",
        "parallelism.data_parallel_shard_strategy",
        "contradicts",
    ),
    (
        "param-dtype-alias-conflict",
        "model:\n  compute_dtype: float32\nparallelism:\n  param_dtype: bf16\n",
        "parallelism.param_dtype",
        "contradicts model.compute_dtype",
    ),
    ("lora-dropout", "lora_config:\n  lora_dropout: 1.5\n", "lora_config.lora_dropout", "[0, 1)"),
    ("eval-interval-no-data", "training:\n  eval_interval: 10\n", "training.eval_interval", "eval_dataset"),
    ("deepseek-only-kernel", "kernels:\n  use_ascend_mhc: true\n", "kernels.use_ascend_mhc", "deepseek_v4"),
    (
        "pp-auto-divisible",
        "model:\n  num_hidden_layers: 5\nparallelism:\n  pipeline_parallel: 2\n",
        "parallelism.pipeline_parallel_layers_per_stage",
        "divisible",
    ),
    (
        "pp-stage-chunks",
        "parallelism:\n  pipeline_parallel: 2\n  pipeline_parallel_interleave_num: 2\n"
        "  pipeline_parallel_layers_per_stage: ['0-1,4-5', '2-3']\n",
        "parallelism.pipeline_parallel_layers_per_stage[1]",
        "needs pipeline_parallel_interleave_num = 2",
    ),
    (
        "pp-stage-gap",
        "model:\n  num_hidden_layers: 8\nparallelism:\n  pipeline_parallel: 2\n"
        "  pipeline_parallel_layers_per_stage: ['0-2', '4-7']\n",
        "parallelism.pipeline_parallel_layers_per_stage",
        "starts at layer 4, expected 3",
    ),
    (
        "pp-stage-short",
        "model:\n  num_hidden_layers: 8\nparallelism:\n  pipeline_parallel: 2\n"
        "  pipeline_parallel_layers_per_stage: ['0-2', '3-6']\n",
        "parallelism.pipeline_parallel_layers_per_stage",
        "the model has 8 layers",
    ),
    (
        "recompute-modules-mode",
        "recompute:\n  modules: ['model.layers.{*}']\n",
        "recompute.modules",
        "'full'",
    ),
]


@pytest.mark.parametrize(("text", "path", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_key_path(tmp_path, text, path, words):
    err = _error(tmp_path, text)
    paths = [p for p, _ in err.issues]
    assert path in paths, str(err)
    reason = dict(err.issues)[path]
    assert words in reason, str(err)
    assert f"error: {path}: " in str(err)


def test_there_are_at_least_thirty_bad_configs():
    assert len(BAD) >= 30


def test_error_carries_file_line(tmp_path):
    err = _error(tmp_path, "checkpoint:\n  prefix: x\ntraining:\n  seed: 1\n  steps: -3\n")
    assert "train.yaml:5" in str(err)


def test_an_override_error_names_the_command_line_not_a_line_of_the_file(tmp_path):
    text = "training:\n  seed: 1\n  steps: 3\n  max_norm: 1.0\n"
    typo = _error(tmp_path, text, ["--training.stpes=10"])
    assert "(command line)" in str(typo) and "train.yaml" not in str(typo)
    written = _error(tmp_path, text, ["--training.max_norm=0"])
    assert "training.max_norm: must be positive, got 0.0 (command line)" in str(written)
    # A key the override did not touch keeps its file and line.
    mixed = _error(tmp_path, "training:\n  seed: 1\n  steps: -3\n", ["--training.max_norm=0"])
    assert "(command line)" in str(mixed) and "train.yaml:3" in str(mixed)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in info.value.issues[0][0]
    assert "not found" in str(info.value)


def test_malformed_yaml_gives_file_and_line(tmp_path):
    err = _error(tmp_path, "training:\n  steps: [1, 2\nmodel:\n  x: 1\n")
    assert "train.yaml:" in err.issues[0][0]
    assert "malformed YAML" in str(err)


def test_duplicate_key_is_an_error(tmp_path):
    err = _error(tmp_path, "training:\n  steps: 1\n  steps: 2\n")
    assert err.issues[0][0].endswith("train.yaml:3")
    assert "duplicate key 'steps'" in str(err)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    err = _error(tmp_path, text)
    assert "must be a mapping" in str(err)


def test_bad_override_syntax(tmp_path):
    err = _error(tmp_path, "training:\n  steps: 2\n", overrides=["--training.steps"])
    assert "--section.key=value" in str(err)


def test_override_into_scalar(tmp_path):
    err = _error(tmp_path, "training:\n  steps: 2\n", overrides=["--training.steps.x=1"])
    assert err.issues[0][0] == "training.steps"


def test_override_typed_value_is_validated(tmp_path):
    err = _error(tmp_path, "", overrides=["--training.local_batch_size=-2"])
    assert err.issues[0][0] == "training.local_batch_size"


# --- MindSpeed format ---


def test_mindspeed_unknown_key_with_suggestion(tmp_path):
    err = _error(tmp_path, "model_name_or_path: /m\nper_device_train_batch_sise: 2\noutput_dir: ./o\n")
    assert err.issues[0][0] == "per_device_train_batch_sise"
    assert "did you mean 'per_device_train_batch_size'" in str(err)


def test_mindspeed_unknown_grouped_key(tmp_path):
    err = _error(tmp_path, "model:\n  model_name_or_path: /m\nparallel:\n  tp_sise: 2\n")
    assert err.issues[0][0] == "parallel.tp_sise"
    assert "tp_size" in str(err)


def test_mindspeed_key_in_wrong_group(tmp_path):
    err = _error(tmp_path, "model:\n  model_name_or_path: /m\nparallel:\n  lr: 1.0e-5\n")
    assert err.issues[0][0] == "parallel.lr"
    assert "'training' group" in str(err)


def test_mindspeed_bad_choice(tmp_path):
    err = _error(tmp_path, "model_name_or_path: /m\nlr_scheduler_type: polynomial\n")
    assert err.issues[0][0] == "lr_scheduler_type"
    assert "cosine" in str(err)


def test_mixed_formats_name_a_key_of_each(tmp_path):
    err = _error(tmp_path, "checkpoint:\n  save_max: 2\ndata:\n  dataset: alpaca\n")
    text = str(err)
    assert "'data'" in text and "'checkpoint'" in text and "mixes" in text


def test_mixed_training_keys(tmp_path):
    err = _error(tmp_path, "training:\n  steps: 10\n  per_device_train_batch_size: 2\n")
    text = str(err)
    assert "training.per_device_train_batch_size" in text and "training.steps" in text


def test_forced_native_format_rejects_mindspeed_keys(tmp_path):
    err = _error(tmp_path, "model_name_or_path: /m\n", fmt="native")
    assert err.issues[0][0] == "model_name_or_path"
    assert "Unknown configuration keys for the top level" in str(err)


def test_too_deep_nesting(tmp_path):
    text = "model:\n  x: " + "[" * 40 + "]" * 40 + "\n"
    err = _error(tmp_path, text)
    assert "nesting is too deep" in str(err)


@pytest.mark.parametrize(
    ("stage", "loader"),
    [("sft", "TextDataLoader"), ("pt", "SFTDataLoader")],
)
def test_training_stage_must_match_the_loader(stage: str, loader: str) -> None:
    from meshforge.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"stage": stage}, "train_dataset": {"dataloader": {"type": loader}}})
    assert info.value.issues[0][0] == "training.stage"
    assert loader in info.value.issues[0][1]


def test_training_stage_unwritten_follows_the_loader() -> None:
    from meshforge.config import config_from_dict

    cfg = config_from_dict({"train_dataset": {"dataloader": {"type": "SFTDataLoader"}}})
    assert cfg.training.stage == "pt"  # the default is not a contradiction


def test_loader_option_typo_is_an_error_of_validate_and_of_train(tmp_path):
    from meshforge.config import check_trainable, validate_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "train_dataset:\n  dataloader:\n    type: TextDataLoader\n    data_path: x.jsonl\n"
        "    seq_length: 8\n    text_kye: body\n",
        encoding="utf-8",
    )
    cfg = load_config(path)  # loads: the options are checked by the loader's own model
    assert cfg.train_dataset.seq_length() == 8
    [(key, reason)] = cfg.train_dataset.dataloader.option_issues()
    assert key == "text_kye" and "did you mean 'text_key'" in reason
    report = validate_config(cfg)
    assert ("train_dataset.dataloader.text_kye", reason) in report.errors
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.text_kye"):
        check_trainable(cfg)
