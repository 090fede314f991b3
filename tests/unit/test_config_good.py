"""Good configs: defaults, reference examples, number coercion, overrides, dump round trip, MindSpeed import."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshforge.config import TrainConfig, config_from_dict, dump_config, load_config, unsupported_features
from meshforge.config.base import ConfigError
from meshforge.config.layer_spec import LayerRange, expand_layers
from meshforge.config.loader import detect_format, parse_yaml

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = sorted((FIXTURES / "reference_yaml").glob("*.yaml"))


def _load(tmp_path, text: str, overrides=(), **kwargs) -> TrainConfig:
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, overrides, **kwargs)


def test_empty_file_gives_defaults(tmp_path):
    cfg = _load(tmp_path, "")
    assert cfg == TrainConfig()
    assert cfg.training.steps == 1000 and cfg.checkpoint.save_max == 5
    assert cfg.context.device_target == "auto"
    assert cfg.callbacks == [] and cfg.lora_config is None


def test_no_path_gives_defaults():
    assert load_config(None) == TrainConfig()


def test_reference_defaults_match_notes():
    cfg = TrainConfig()
    assert cfg.parallelism.data_parallel_shard == -1
    assert cfg.parallelism.context_parallel_method == "colossal"
    assert cfg.parallelism.npu_nums_per_device == 8
    assert cfg.optimizer.betas == [0.9, 0.95] and cfg.optimizer.eps == 1e-8
    assert cfg.optimizer.accumulate_allreduce_grads_in_fp32 is True
    assert cfg.lr_scheduler.type is None and cfg.lr_scheduler.learning_rate == 1e-5
    assert cfg.train_dataset.dataloader.column_names == ["input_ids", "labels"]
    assert cfg.train_dataset.num_parallel_workers == 8
    assert cfg.monitor.health_checkpoint.global_norm_skip_time == 10
    assert cfg.monitor.train_state.local_norm == ""
    assert cfg.profiler.profile_cpu is True and cfg.profiler.with_stack is True
    assert cfg.recompute.mode == "None" and cfg.swap.default_prefetch == 1
    assert cfg.context.max_device_memory == "59GB"
    assert cfg.checkpoint.no_load_optim is False


def test_config_is_frozen():
    cfg = TrainConfig()
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on frozen assignment
        cfg.training.steps = 3


@pytest.mark.parametrize("path", REFERENCE, ids=[p.stem for p in REFERENCE])
def test_every_reference_example_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)


def test_skeleton_values():
    cfg = load_config(FIXTURES / "reference_yaml" / "skeleton.yaml")
    assert cfg.training.global_batch_size == 8
    assert cfg.optimizer.eps == 1e-8
    assert cfg.model.model_type == "deepseek_v3" and cfg.model.compute_dtype == "bfloat16"
    assert cfg.model.model_extra["num_hidden_layers"] == 12
    assert cfg.train_dataset.seq_length() == 4096
    assert cfg.train_dataset.dataloader.model_extra["config"]["data_path"] == [
        "1",
        "/path/megatron_data_text_document",
    ]
    assert cfg.monitor.moe_monitor.target_layers == [0, 1, 2]


def test_recompute_select_example_layers():
    cfg = load_config(FIXTURES / "reference_yaml" / "recompute_select.yaml")
    assert cfg.recompute.select_module == {"attention": [LayerRange(0, 1)], "mlp": [LayerRange(2, 2)]}
    assert expand_layers([LayerRange(0, 3), LayerRange(5, 5)]) == [0, 1, 2, 3, 5]


def test_tensor_parallel_without_sequence_parallel_is_fine(tmp_path):
    cfg = _load(tmp_path, "parallelism:\n  tensor_parallel: 2\n")
    assert cfg.parallelism.tensor_parallel == 2 and cfg.parallelism.sequence_parallel is False


def test_number_coercion(tmp_path):
    text = "optimizer:\n  eps: 1e-8\n  weight_decay: '0.1'\ntraining:\n  steps: '10'\n  max_norm: 2\nlr_scheduler:\n  learning_rate: 3e-4\n"
    cfg = _load(tmp_path, text)
    assert cfg.optimizer.eps == 1e-8 and cfg.optimizer.weight_decay == 0.1
    assert cfg.training.steps == 10 and isinstance(cfg.training.steps, int)
    assert cfg.training.max_norm == 2.0 and cfg.lr_scheduler.learning_rate == 3e-4


def test_exponent_floats_in_passthrough_keys_are_numbers():
    assert parse_yaml("a: 1e-8\nb: 5E+3\nc: '1e-8'\nd: 1.e-3") == {
        "a": 1e-8,
        "b": 5e3,
        "c": "1e-8",
        "d": 1e-3,
    }


def test_layer_spec_forms(tmp_path):
    text = "recompute:\n  mode: full\n  full_recompute_layer: ['0-1', '3', 5, ' 7-9 ']\n"
    cfg = _load(tmp_path, text)
    assert cfg.recompute.full_recompute_layer == [
        LayerRange(0, 1),
        LayerRange(3, 3),
        LayerRange(5, 5),
        LayerRange(7, 9),
    ]


def test_null_is_a_real_value(tmp_path):
    cfg = _load(tmp_path, "checkpoint:\n  save_max: null\nlr_scheduler:\n  type: null\n")
    assert cfg.checkpoint.save_max is None and cfg.lr_scheduler.type is None


def test_null_section_means_defaults(tmp_path):
    cfg = _load(tmp_path, "recompute:\nswap:\n")
    assert cfg.recompute.mode == "None"


def test_passthrough_keys_kept(tmp_path):
    text = "model:\n  model_type: qwen3\n  hidden_size: 64\nlr_scheduler:\n  type: ConstantWarmUpLR\n  warmup_steps: 5\n"
    cfg = _load(tmp_path, text)
    assert cfg.model.model_extra == {"hidden_size": 64}
    assert cfg.lr_scheduler.model_extra == {"warmup_steps": 5}


def test_overrides_scalars_lists_dicts(tmp_path):
    cfg = _load(
        tmp_path,
        "training:\n  steps: 5\n",
        overrides=[
            "--training.steps=100",
            "training.seed=7",
            "--optimizer.betas=[0.8, 0.9]",
            "--model.rope_scaling={type: linear, factor: 2.0}",
            "--checkpoint.prefix=123",
            "--lr_scheduler.learning_rate=1e-4",
            "--checkpoint.save_max=null",
        ],
    )
    assert cfg.training.steps == 100 and cfg.training.seed == 7
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.model.model_extra["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert cfg.checkpoint.prefix == "123"
    assert cfg.lr_scheduler.learning_rate == 1e-4
    assert cfg.checkpoint.save_max is None


def test_dump_round_trip_reference_skeleton():
    cfg = load_config(FIXTURES / "reference_yaml" / "skeleton.yaml")
    text = dump_config(cfg)
    again = config_from_dict(parse_yaml(text))
    assert again == cfg
    assert "vocab_size: 129280" in text and "full_recompute_layer: null" in text


@pytest.mark.parametrize(
    "monitor", ["", "monitor:\n  wandb:\n    project: p\n", "monitor:\n  report_to: none\n"]
)
def test_a_dumped_config_runs_the_same_trackers(tmp_path, monitor):
    # A run's config.yaml loads back to the run it describes: an unused tracker section written
    # out would switch that tracker on (and stop a run without its package).
    cfg = _load(tmp_path, monitor)
    again = config_from_dict(parse_yaml(dump_config(cfg)))
    assert again == cfg
    assert again.monitor.trackers() == cfg.monitor.trackers()


def test_dump_round_trip_with_layer_specs_and_strings(tmp_path):
    text = (
        "recompute:\n  mode: select\n  select_module:\n    attention: ['0-1', 3]\n"
        "model:\n  model_type: qwen3\n  note: '1e-8'\nlora_config:\n  exclude_layers: ['2']\n"
        "callbacks:\n  - type: Printer\n    every: 3\n"
    )
    cfg = _load(tmp_path, text)
    dumped = dump_config(cfg)
    again = config_from_dict(parse_yaml(dumped))
    assert again == cfg
    assert again.model.model_extra["note"] == "1e-8"
    assert again.callbacks[0].model_extra == {"every": 3}


def test_dtype_aliases(tmp_path):
    cfg = _load(tmp_path, "model:\n  compute_dtype: bf16\n  params_dtype: FP32\n")
    assert cfg.model.compute_dtype == "bfloat16" and cfg.model.params_dtype == "float32"


def test_device_aliases(tmp_path):
    assert _load(tmp_path, "context:\n  device_target: Ascend\n").context.device() == "npu"
    assert _load(tmp_path, "context:\n  device_target: GPU\n").context.device() == "cuda"


def test_seq_length_sources(tmp_path):
    cfg = _load(
        tmp_path,
        "train_dataset:\n  dataloader:\n    type: TextDataLoader\n    seq_length: 256\nmodel:\n  seq_length: 256\n",
    )
    assert cfg.train_dataset.seq_length() == 256
    assert cfg.train_dataset.seq_length_source() == (256, "train_dataset.dataloader.seq_length")
    cfg = _load(tmp_path, "train_dataset:\n  dataloader:\n    type: SFTDataLoader\n  cutoff_len: 1024\n")
    assert cfg.train_dataset.seq_length() == 1024
    assert cfg.train_dataset.seq_length_source() == (1024, "train_dataset.cutoff_len")
    assert TrainConfig().train_dataset.seq_length() is None


def test_neat_packing_forces_packing(tmp_path):
    cfg = _load(tmp_path, "train_dataset:\n  neat_packing: true\n")
    assert cfg.train_dataset.packing is True


def test_gradient_accumulation_and_batch(tmp_path):
    cfg = _load(tmp_path, "training:\n  local_batch_size: 2\n  gradient_accumulation_steps: 4\n")
    assert cfg.training.accumulation_steps(dp=2) == 4
    assert cfg.training.effective_global_batch_size(dp=2) == 16
    cfg = _load(tmp_path, "training:\n  local_batch_size: 2\n  global_batch_size: 10\n")
    assert cfg.training.accumulation_steps(dp=2) == 2  # rounds down like the reference
    with pytest.raises(ValueError, match="training.global_batch_size"):
        cfg.training.accumulation_steps(dp=8)


def test_ring_is_colossal(tmp_path):
    cfg = _load(tmp_path, "parallelism:\n  context_parallel_method: ring\n")
    assert cfg.parallelism.cp_method() == "colossal"


def test_reshard_alias_sets_policy(tmp_path):
    assert (
        _load(
            tmp_path, "parallelism:\n  reshard_after_forward: false\n"
        ).parallelism.reshard_after_forward_policy
        == "never"
    )
    cfg = _load(
        tmp_path, "parallelism:\n  reshard_after_forward: true\n  reshard_after_forward_policy: always\n"
    )
    assert cfg.parallelism.reshard_after_forward_policy == "always"


def test_braces_pattern_normalised(tmp_path):
    cfg = _load(tmp_path, "parallelism:\n  fsdp_modules: ['model.layers.{}', lm_head]\n")
    assert cfg.parallelism.fsdp_modules == ["model.layers.{*}", "lm_head"]


# --- MindSpeed format ---


def test_detect_format():
    assert detect_format({}) == "native"
    assert detect_format({"training": {"steps": 3}}) == "native"
    assert detect_format({"model_name_or_path": "/m"}) == "mindspeed"
    assert detect_format({"model": {"model_name_or_path": "/m"}, "data": {}}) == "mindspeed"
    assert detect_format({"training": {"lr": 1e-5}}) == "mindspeed"
    assert detect_format({"recompute": True}) == "mindspeed"
    assert detect_format({"recompute": {"mode": "None"}}) == "native"
    assert detect_format({"optimizer": "adamw"}) == "mindspeed"


def test_mindspeed_grouped_import():
    lines: list[str] = []
    cfg = load_config(FIXTURES / "mindspeed" / "qwen3_sft_grouped.yaml", log=lines.append)
    assert cfg.model.model_name_or_path == "./model_from_hf/qwen3-0.6b" and cfg.model.model_id == "qwen3"
    assert cfg.model.init_model_with_meta_device is True
    assert cfg.train_dataset.dataloader.type == "SFTDataLoader"
    assert cfg.train_dataset.dataset == "alpaca_zh,sharegpt_demo"
    assert cfg.train_dataset.cutoff_len == 4096 and cfg.train_dataset.seq_length() == 4096
    assert cfg.train_dataset.probabilities() == [0.7, 0.3]
    assert cfg.parallelism.data_parallel_shard == -1
    assert cfg.parallelism.fsdp_modules == ["model.layers.{*}", "model.embed_tokens", "lm_head"]
    assert cfg.model.compute_dtype == "bfloat16" and cfg.model.params_dtype == "float32"
    assert cfg.parallelism.param_dtype is None and cfg.parallelism.reduce_dtype == "float32"
    assert cfg.recompute.mode == "full" and cfg.recompute.modules == ["model.layers.{*}"]
    assert cfg.training.output_dir == "./output/qwen3_sft"
    assert cfg.training.local_batch_size == 1 and cfg.training.gradient_accumulation_steps == 4
    assert cfg.training.steps == 2000 and cfg.training.epochs is None
    assert cfg.training.log_interval == 10 and cfg.training.seed == 1234 and cfg.training.stage == "sft"
    assert cfg.training.deterministic is True  # MindSpeed default kept
    assert cfg.lr_scheduler.type == "CosineWithWarmUpLR" and cfg.lr_scheduler.learning_rate == 1e-5
    assert cfg.lr_scheduler.model_extra == {"warmup_ratio": 0.1, "min_lr": 1e-6}
    assert cfg.optimizer.betas == [0.9, 0.999]
    assert cfg.checkpoint.save_interleaved_steps == 500 and cfg.checkpoint.save_max == 2
    assert cfg.kernels.use_flash_attn is True and cfg.kernels.use_fused_rmsnorm is True
    assert cfg.train_dataset.dataloader.shuffle is True  # disable_shuffling defaults to False
    assert any(line.startswith("lr -> lr_scheduler.learning_rate") for line in lines)
    assert any("max_steps -> training.steps = 2000" in line for line in lines)


def test_mindspeed_flat_megatron_import():
    cfg = load_config(FIXTURES / "mindspeed" / "pretrain_flat.yaml")
    loader = cfg.train_dataset.dataloader
    assert loader.type == "BlendedMegatronDatasetDataLoader"
    assert loader.model_extra["config"] == {
        "data_path": ["0.5", "/data/enwiki_text_document", "0.5", "/data/books_text_document"],
        "seq_length": 2048,
        "split": "99,1,0",
    }
    assert cfg.train_dataset.seq_length() == 2048
    assert cfg.training.stage == "pt" and cfg.training.local_batch_size == 2 and cfg.training.steps == 100
    assert cfg.training.deterministic is False
    assert cfg.lr_scheduler.model_extra["min_lr"] == 3e-5
    assert loader.shuffle is False
    assert cfg.checkpoint.no_save_optim is True
    assert cfg.checkpoint.load_path == "./output/qwen3_pt/checkpoints/global_step_50"
    assert cfg.parallelism.context_parallel == 2 and cfg.parallelism.context_parallel_method == "colossal"
    prof = cfg.profiler
    assert prof.enable_profiling and (prof.start_step, prof.end_step) == (5, 7)
    assert prof.profiler_rank == [0, 1] and prof.profiler_level == 1
    # The profiler is built: the imported window is consumed, not refused.
    assert not [key for key in unsupported_features(cfg) if key.startswith("profiler.")]


def test_mindspeed_defaults_applied(tmp_path):
    cfg = _load(tmp_path, "model_name_or_path: /m\noutput_dir: ./o\n")
    assert cfg.training.local_batch_size == 8 and cfg.training.gradient_accumulation_steps == 1
    assert cfg.training.epochs == 3.0  # max_steps -1: train by epochs, as MindSpeed does
    assert cfg.lr_scheduler.type == "CosineWithWarmUpLR"
    assert cfg.lr_scheduler.model_extra == {"warmup_ratio": 0.03, "min_lr": 1e-6}
    assert cfg.checkpoint.save_max == 3 and cfg.training.deterministic is True
    assert cfg.model.compute_dtype == "bfloat16"  # MindSpeed param_dtype bf16
    assert cfg.train_dataset.drop_remainder is False and cfg.train_dataset.num_parallel_workers == 0


def test_mindspeed_resume_from_checkpoint_true_is_auto(tmp_path):
    """The HF Trainer's `true` (the output folder's latest checkpoint) is `auto`; `false` loads nothing."""
    on = _load(tmp_path, "model_name_or_path: /m\noutput_dir: ./o\nresume_from_checkpoint: true\n")
    assert on.checkpoint.load_path == "auto"
    off = _load(tmp_path, "model_name_or_path: /m\noutput_dir: ./o\nresume_from_checkpoint: false\n")
    assert off.checkpoint.load_path == ""


def test_mindspeed_constant_scheduler_drops_min_lr(tmp_path):
    lines: list[str] = []
    cfg = _load(
        tmp_path,
        "model_name_or_path: /m\nlr_scheduler_type: constant\nmin_lr: 0.1\nmax_steps: 3\n",
        log=lines.append,
    )
    assert cfg.lr_scheduler.type == "ConstantWarmUpLR" and "min_lr" not in cfg.lr_scheduler.model_extra
    assert any("min_lr -> unused" in line for line in lines)


def test_mindspeed_overrides_apply_before_import(tmp_path):
    cfg = _load(
        tmp_path,
        "model_name_or_path: /m\nmax_steps: 10\n",
        overrides=["--training.lr=2e-5", "--training.steps=7"],
    )
    assert cfg.lr_scheduler.learning_rate == 2e-5
    assert cfg.training.steps == 7


def test_forced_mindspeed_format(tmp_path):
    cfg = _load(tmp_path, "model:\n  model_name_or_path: /m\ntraining:\n  output_dir: ./x\n", fmt="mindspeed")
    assert cfg.training.local_batch_size == 8 and cfg.train_dataset.dataloader.type == "SFTDataLoader"
    native = _load(tmp_path, "model:\n  model_name_or_path: /m\ntraining:\n  output_dir: ./x\n")
    assert native.training.local_batch_size == 1


@pytest.mark.procs
def test_config_load_does_not_import_torch(tmp_path):
    import subprocess

    path = FIXTURES / "reference_yaml" / "skeleton.yaml"
    code = (
        "import sys\n"
        "from meshforge.config import load_config, dump_config, validate_config\n"
        f"cfg = load_config({str(path)!r})\n"
        "dump_config(cfg)\n"
        "from meshforge.config.schema import schema_json; schema_json()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_mapping_doc_lists_every_mindspeed_key():
    from meshforge.config.importer import ALL_KEYS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config-mapping.md").read_text(encoding="utf-8")
    assert [key for key in ALL_KEYS if f"| `{key}` |" not in doc] == []


SECTION_MODULES = [
    "meshforge.models.config",
    "meshforge.parallel.config",
    "meshforge.data.config",
    "meshforge.optim.config",
    "meshforge.train.config",
    "meshforge.checkpoint.config",
    "meshforge.memory.config",
    "meshforge.monitor.config",
    "meshforge.monitor.profiling",
    "meshforge.train.callbacks",
    "meshforge.utils.context_config",
    "meshforge.infer.config",
]


@pytest.mark.procs
def test_each_section_module_imports_first_without_torch():
    """Components import their own section first: no circular import, no torch."""
    import subprocess

    code = (
        "import importlib, sys\n"
        "name = sys.argv[1]\n"
        "importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules, name\n"
    )
    for name in SECTION_MODULES:
        proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"


def test_pipeline_stage_strings(tmp_path):
    text = (
        "model:\n  num_hidden_layers: 8\nparallelism:\n  pipeline_parallel: 2\n  pipeline_parallel_interleave_num: 2\n"
        "  pipeline_parallel_layers_per_stage: ['0-1,4-5', '2-3,6-7']\n"
    )
    cfg = _load(tmp_path, text)
    from meshforge.config.rules import stage_chunks

    assert stage_chunks(cfg.parallelism.pipeline_parallel_layers_per_stage) == [
        [LayerRange(0, 1), LayerRange(4, 5)],
        [LayerRange(2, 3), LayerRange(6, 7)],
    ]


def test_param_dtype_is_an_alias_of_compute_dtype() -> None:
    """MindSpeed's parallelism.param_dtype sets model.compute_dtype when that is not written."""
    cfg = config_from_dict({"parallelism": {"param_dtype": "bf16"}})
    assert cfg.model.compute_dtype == "bfloat16"
    same = config_from_dict({"parallelism": {"param_dtype": "fp16"}, "model": {"compute_dtype": "fp16"}})
    assert same.model.compute_dtype == "float16"


def test_zero2_strategy_keeps_gathered_weights_until_backward() -> None:
    cfg = config_from_dict({"parallelism": {"data_parallel_shard_strategy": "optim_grads"}})
    assert cfg.parallelism.reshard_after_forward_policy == "never"


def _dtype_keys() -> list[tuple[str, str]]:
    """Every (section, field) whose type is the shared dtype name, found by walking the sections."""
    from typing import get_args

    from meshforge.config.base import DtypeName

    names = get_args(DtypeName)[0]  # pydantic keeps the Literal and moves the validator to metadata
    keys = []
    for section, info in TrainConfig.model_fields.items():
        model = info.annotation
        fields = getattr(model, "model_fields", None)
        for name, field in (fields or {}).items():
            if field.annotation in (DtypeName, DtypeName | None, names, names | None):
                keys.append((section, name))
    return keys


def test_every_dtype_key_takes_every_spelling() -> None:
    keys = _dtype_keys()
    # The four dtype keys of the reference documents, so a key typed otherwise is noticed.
    assert {("model", "compute_dtype"), ("model", "params_dtype"), ("parallelism", "param_dtype")} <= set(
        keys
    )
    assert ("parallelism", "reduce_dtype") in keys
    for section, name in keys:
        for spelling, canonical in [
            ("bf16", "bfloat16"),
            ("BFloat16", "bfloat16"),
            ("fp16", "float16"),
            ("float16", "float16"),
            ("fp32", "float32"),
            ("float32", "float32"),
        ]:
            data = {section: {name: spelling}}
            if (section, name) == ("parallelism", "param_dtype"):
                data["model"] = {"compute_dtype": canonical}  # the alias must agree when both are set
            cfg = config_from_dict(data)
            assert getattr(getattr(cfg, section), name) == canonical, (section, name, spelling)
        with pytest.raises(ConfigError, match=rf"{section}\.{name}: must be float32, bfloat16 or float16"):
            config_from_dict({section: {name: "bf61"}})


def test_importers_own_zero_workers_default_is_not_reported_as_a_noop(tmp_path):
    from meshforge.config.noops import noop_notes

    absent = _load(tmp_path, "model_name_or_path: /m\noutput_dir: ./o\n")
    assert absent.train_dataset.num_parallel_workers == 0
    assert not [key for key, _ in noop_notes(absent, "cpu") if key == "train_dataset.num_parallel_workers"]
    given = _load(tmp_path, "model_name_or_path: /m\noutput_dir: ./o\ndataloader_num_workers: 4\n")
    assert [key for key, _ in noop_notes(given, "cpu") if key == "train_dataset.num_parallel_workers"]
