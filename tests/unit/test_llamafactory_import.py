"""LLaMA-Factory training YAMLs as a config format: detection, every argument accounted for, the
real example files of LLaMA-Factory (tests/data/llamafactory, see its README), DeepSpeed JSONs,
`trust_remote_code`, hub ids offline, and the generated table in docs/config-mapping.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.cli.config import main as config_main
from meshforge.config import ConfigError
from meshforge.config.llamafactory_args import ARGUMENTS, BY_NAME
from meshforge.config.llamafactory_import import import_llamafactory
from meshforge.config.llamafactory_rules import MAPPED, REFUSED, WARNED, disposition, markdown_table
from meshforge.config.loader import (
    config_from_dict,
    detect_format,
    load_config,
    read_config_file,
    validate_imported,
)

ROOT = Path(__file__).resolve().parents[2]
LF = ROOT / "tests" / "data" / "llamafactory"
EXAMPLES = sorted((LF / "examples").rglob("*.yaml"))
MODEL = str(ROOT / "assets" / "models" / "qwen3-tiny")  # a local folder with a config.json

# What each copied example needs that meshforge does not build (empty: it maps fully).
UNBUILT: dict[str, set[str]] = {
    "extras/adam_mini/qwen2_full_sft.yaml": {"use_adam_mini"},
    "extras/apollo/llama3_full_sft.yaml": {"use_apollo", "apollo_layerwise", "apollo_rank"},
    "extras/badam/llama3_full_sft.yaml": {"use_badam", "badam_verbose"},
    "extras/dft/qwen2_full_sft.yaml": {"use_dft_loss"},
    "extras/fp8/llama3_fp8_deepspeed_sft.yaml": set(),
    "extras/fp8/llama3_fp8_fsdp_sft.yaml": set(),
    "extras/galore/llama3_full_sft.yaml": {"use_galore", "galore_layerwise", "galore_rank"},
    "extras/llama_pro/llama3_freeze_sft.yaml": {
        "finetuning_type",
        "freeze_trainable_layers",
        "use_llama_pro",
    },
    "extras/loraplus/llama3_lora_sft.yaml": {"loraplus_lr_ratio"},
    "extras/mod/llama3_full_sft.yaml": {"mixture_of_depths", "optim"},
    "extras/muon/qwen2_full_sft.yaml": {"template"},  # LLaMA-Factory's Qwen2 template `qwen`
    "extras/oft/llama3_oft_sft.yaml": {"finetuning_type"},
    "extras/pissa/llama3_lora_sft.yaml": {"pissa_init", "pissa_convert"},
    "megatron/qwen3_moe_full.yaml": set(),
    "train_full/qwen3_full_sft.yaml": set(),
    "train_lora/qwen3_lora_dpo.yaml": set(),
    "train_lora/qwen3_lora_kto.yaml": {"stage"},
    "train_lora/qwen3_lora_pretrain.yaml": set(),
    "train_lora/qwen3_lora_reward.yaml": set(),
    "train_lora/qwen3_lora_sft.yaml": set(),
    "train_lora/qwen3_lora_sft_ds3.yaml": set(),
    "train_lora/qwen3_lora_sft_ray.yaml": {"ray_num_workers"},
    "train_lora/qwen3vl_lora_sft.yaml": {"image_max_pixels", "video_max_pixels"},
    "train_qlora/qwen3_lora_sft_otfq.yaml": {"quantization_bit"},
}


def _example(path: Path) -> dict[str, object]:
    data, _ = read_config_file(path)
    data["model_name_or_path"] = MODEL  # the only edit: a local folder for the hub id
    return data


def test_every_copied_example_is_listed() -> None:
    assert sorted(str(p.relative_to(LF / "examples")) for p in EXAMPLES) == sorted(UNBUILT)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(LF / "examples")))
def test_example_maps_fully_or_names_each_unbuilt_key(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(LF)  # the examples name their DeepSpeed JSON and data relative to LLaMA-Factory's root
    data = _example(path)
    assert detect_format(data) == "llamafactory"
    expected = UNBUILT[str(path.relative_to(LF / "examples"))]
    origins: dict[str, tuple[str, object]] = {}
    try:
        native = import_llamafactory(data, origins=origins)
        validate_imported(native, origins, fmt="llamafactory")  # the result is a valid native config
        issues: list[tuple[str, str]] = []
    except ConfigError as err:
        issues = err.issues
    assert {key for key, _ in issues} == expected
    assert all("not supported yet: " in reason for _, reason in issues), issues


# Values that exercise a mapped key (the importer reads them in context); every other argument
# gets a value unlike its default from `_other`.
DATA = str(LF / "data")
VALUES: dict[str, dict[str, object]] = {
    "model_name_or_path": {"model_name_or_path": str(ROOT / "assets" / "tokenizer")},
    "moe_aux_loss_coef": {"moe_aux_loss_coef": 0.01},
    "flash_attn": {"flash_attn": "fa2"},
    "packing": {"packing": True},
    "stage": {"stage": "pt", "dataset": "c4_demo", "dataset_dir": DATA},
    "finetuning_type": {"finetuning_type": "full"},
    "per_device_eval_batch_size": {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4},
    "lr_scheduler_type": {"lr_scheduler_type": "cosine"},
    "lr_scheduler_kwargs": {
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr": 1e-6},
    },
    "optim": {"optim": "adamw_torch"},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "torch_compile_backend": {"torch_compile_backend": "inductor"},
    "report_to": {"report_to": "tensorboard"},
    "eval_strategy": {"eval_strategy": "steps", "eval_steps": 5},
    "save_strategy": {"save_strategy": "no"},
    "save_total_limit": {"save_total_limit": 2},
    "dataloader_prefetch_factor": {"dataloader_prefetch_factor": 2},
    "fsdp": {"fsdp": "full_shard auto_wrap"},
    "fsdp_config": {"fsdp_config": {"transformer_layer_cls_to_wrap": "Qwen3DecoderLayer"}},
    "deepspeed": {"deepspeed": str(LF / "examples" / "deepspeed" / "ds_z3_config.json")},
    "resume_from_checkpoint": {"resume_from_checkpoint": True},
    "tensor_model_parallel_size": {"tensor_model_parallel_size": 2},
    "pipeline_model_parallel_size": {"pipeline_model_parallel_size": 2},
    "virtual_pipeline_model_parallel_size": {"virtual_pipeline_model_parallel_size": 2},
    "context_parallel_size": {"context_parallel_size": 2},
    "expert_model_parallel_size": {"expert_model_parallel_size": 2},
    "recompute_granularity": {"recompute_granularity": "full"},
    "recompute_method": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "recompute_num_layers": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 1,
    },
    "moe_token_dispatcher_type": {"moe_token_dispatcher_type": "alltoall"},
    "moe_aux_loss_coeff": {"moe_aux_loss_coeff": 0.01},
    "moe_grouped_gemm": {"moe_grouped_gemm": True},
    "micro_batch_size": {"micro_batch_size": 8},
    "use_flash_attn": {"use_flash_attn": True},
}


def _other(default: object) -> object:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return f"{default}_other"
    if isinstance(default, list):
        return ["other"]
    if isinstance(default, dict):
        return {"other": 1}
    return "other"


@pytest.mark.parametrize("name", [arg.name for arg in ARGUMENTS])
def test_each_argument_is_mapped_refused_or_warned(name: str) -> None:
    """Each argument, at a value unlike its default, is in the log or refused as its table says."""
    kind, _ = disposition(name)  # KeyError: an argument nobody decided about
    written = VALUES.get(name, {name: _other(BY_NAME[name].default)})
    raw: dict[str, object] = {"model_name_or_path": MODEL, **written}
    lines: list[str] = []
    try:
        import_llamafactory(raw, lines.append)
        issues: list[tuple[str, str]] = []
    except ConfigError as err:
        issues = err.issues
    mine = [line for line in lines if line.startswith((f"{name}:", f"{name} ", f"warning: {name}:"))]
    assert not any("not read by the importer" in reason for _, reason in issues), issues
    if kind == "refused":
        assert (name, f"not supported yet: {name}: {written[name]!r} ({REFUSED[name]})") in issues
    elif kind == "warned":
        assert f"warning: {name}: {written[name]!r} -> no effect: {WARNED[name]}" in lines
    else:
        refused = [r for key, r in issues if key == name and r.startswith(f"not supported yet: {name}")]
        assert refused or [line for line in mine if "nothing to set" not in line], (lines, issues)


def test_the_three_tables_do_not_overlap_and_cover_every_argument() -> None:
    names = [arg.name for arg in ARGUMENTS]
    assert len(names) == len(set(names))
    assert (
        not (set(MAPPED) & set(REFUSED))
        and not (set(MAPPED) & set(WARNED))
        and not (set(REFUSED) & set(WARNED))
    )
    assert set(MAPPED) | set(REFUSED) | set(WARNED) == set(names)


def test_unknown_key_suggests_the_argument_and_refusals_name_value_and_feature() -> None:
    with pytest.raises(ConfigError) as err:
        import_llamafactory(
            {"model_name_or_path": MODEL, "learning_rat": 1e-4, "stage": "ppo", "use_galore": True}
        )
    issues = dict(err.value.issues)
    assert (
        issues["learning_rat"]
        == "unknown LLaMA-Factory argument 'learning_rat'; did you mean 'learning_rate'?"
    )
    assert issues["stage"].startswith("not supported yet: stage: ppo (preference and reward")
    assert issues["use_galore"] == "not supported yet: use_galore: True (GaLore)"


def test_refused_key_at_its_default_is_accepted_and_logged() -> None:
    lines: list[str] = []
    import_llamafactory(
        {"model_name_or_path": MODEL, "use_galore": False, "quantization_bit": None}, lines.append
    )
    assert "use_galore: False -> LLaMA-Factory's default, nothing to do (GaLore: not built)" in lines


def _zero(tmp_path: Path, body: dict[str, object]) -> dict[str, object]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(body))
    lines: list[str] = []
    native = import_llamafactory(
        {"model_name_or_path": MODEL, "finetuning_type": "full", "deepspeed": str(path)}, lines.append
    )
    parallel = native.get("parallelism", {})
    assert isinstance(parallel, dict)
    return {**parallel, "lines": [line for line in lines if line.startswith("deepspeed")]}


def test_deepspeed_stages_map_to_fsdp2(tmp_path: Path) -> None:
    z3 = _zero(tmp_path, json.loads((LF / "examples/deepspeed/ds_z3_offload_config.json").read_text()))
    assert z3["data_parallel_shard_strategy"] == "optim_grads_params" and z3["cpu_offload"] is True
    assert any("ZeRO-3 -> FSDP2 full sharding" in line for line in z3["lines"])  # type: ignore[union-attr]
    z2 = _zero(tmp_path, json.loads((LF / "examples/deepspeed/ds_z2_config.json").read_text()))
    assert z2["data_parallel_shard_strategy"] == "optim_grads" and "cpu_offload" not in z2
    assert any("ZeRO-2 -> FSDP2 optim_grads" in line for line in z2["lines"])  # type: ignore[union-attr]
    z2off = _zero(tmp_path, json.loads((LF / "examples/deepspeed/ds_z2_offload_config.json").read_text()))
    assert z2off["cpu_offload"] is True
    z0 = _zero(tmp_path, json.loads((LF / "examples/deepspeed/ds_z0_config.json").read_text()))
    assert z0["data_parallel_shard"] == 1
    with pytest.raises(ConfigError, match="cannot read the DeepSpeed JSON"):
        import_llamafactory({"model_name_or_path": MODEL, "deepspeed": str(tmp_path / "none.json")})


def test_trust_remote_code_is_refused_only_when_the_folder_needs_it(tmp_path: Path) -> None:
    plain, custom = tmp_path / "plain", tmp_path / "custom"
    for folder, body in ((plain, {"model_type": "qwen3"}), (custom, {"auto_map": {"AutoModel": "m.M"}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(body))
    lines: list[str] = []
    import_llamafactory({"model_name_or_path": str(plain), "trust_remote_code": True}, lines.append)
    assert any(line.startswith("warning: trust_remote_code: True -> no effect") for line in lines)
    with pytest.raises(ConfigError) as err:
        import_llamafactory({"model_name_or_path": str(custom), "trust_remote_code": True})
    (key, reason), *_ = err.value.issues
    assert key == "trust_remote_code" and reason.startswith("not supported yet: trust_remote_code: true")
    assert "config.json names its own code in auto_map" in reason


def test_a_hub_id_offline_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        import_llamafactory({"model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507"})
    assert err.value.issues == [
        (
            "model_name_or_path",
            "'Qwen/Qwen3-4B-Instruct-2507' is not a local folder and downloads are off (HF_HUB_OFFLINE=1): "
            "download it (`hf download Qwen/Qwen3-4B-Instruct-2507 --local-dir DIR`) and give that folder",
        )
    ]


def test_lf_defaults_that_change_the_run_are_written(tmp_path: Path) -> None:
    lines: list[str] = []
    native = import_llamafactory({"model_name_or_path": MODEL, "output_dir": str(tmp_path)}, lines.append)
    cfg = config_from_dict(native)
    assert cfg.optimizer.betas == [0.9, 0.999] and cfg.optimizer.weight_decay == 0.0
    assert cfg.lr_scheduler.type == "LinearWithWarmUpLR" and cfg.lr_scheduler.learning_rate == 5e-5
    assert cfg.lora_config is not None and cfg.lora_config.lora_rank == 8 and cfg.lora_config.lora_alpha == 16
    assert cfg.recompute.mode == "full" and cfg.checkpoint.save_max is None
    assert cfg.checkpoint.export_dir == str(tmp_path) and cfg.monitor.trainer_log
    assert "finetuning_type: 'lora' -> lora_config.lora_rank = 8 (LLaMA-Factory default)" not in lines
    assert "lora_rank (not set) -> lora_config.lora_rank = 8 (LLaMA-Factory default)" in lines


def test_detection_and_mixtures(tmp_path: Path) -> None:
    assert detect_format({"model_name_or_path": "m", "learning_rate": 1e-4}) == "llamafactory"
    assert detect_format({"model_name_or_path": "m", "lr": 1e-4}) == "mindspeed"
    with pytest.raises(ConfigError, match="mixes the LLaMA-Factory format"):
        detect_format({"learning_rate": 1e-4, "tp_size": 2})


def test_config_import_says_which_format_it_detected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(LF)
    source = tmp_path / "lf.yaml"
    source.write_text(
        (LF / "examples/train_lora/qwen3_lora_sft.yaml")
        .read_text()
        .replace("Qwen/Qwen3-4B-Instruct-2507", MODEL)
    )
    out = tmp_path / "native.yaml"
    assert config_main(["import", str(source), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "import: detected format: LLaMA-Factory" in err
    assert "import: learning_rate: 0.0001 -> lr_scheduler.learning_rate" in err
    assert out.read_text().startswith(f"# Imported from {source} (LLaMA-Factory format)")
    cfg = load_config(out)
    assert cfg.lora_config is not None and cfg.lora_config.target_modules == "all"
    assert (
        cfg.train_dataset.dataset == "identity,alpaca_en_demo"
        and cfg.train_dataset.template == "qwen3_nothink"
    )


def test_docs_table_is_generated_from_the_importer_table() -> None:
    doc = (ROOT / "docs" / "config-mapping.md").read_text(encoding="utf-8")
    assert markdown_table() in doc, "regenerate: python -m meshforge.config.llamafactory_rules"


def test_trainer_log_records_lf_fields_on_log_steps_and_resumes(tmp_path: Path) -> None:
    from meshforge.monitor.trainer_log import TrainerLog

    log = TrainerLog(tmp_path, total_steps=4, start_step=0, log_interval=2, steps_per_epoch=2.0)
    for step in (1, 2, 3, 4):
        log.write(
            {
                "step": step,
                "loss": 2.0 / step,
                "lr": 1e-4,
                "elapsed_s": 10.0 * step,
                "tokens_seen": 100 * step,
            }
        )
    log.close()
    records = [json.loads(line) for line in (tmp_path / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in records] == [2, 4]
    assert records[0] == {
        "current_steps": 2,
        "total_steps": 4,
        "loss": 1.0,
        "lr": 1e-4,
        "epoch": 1.0,
        "percentage": 50.0,
        "elapsed_time": "0:00:20",
        "remaining_time": "0:00:20",
        "throughput": 10.0,
        "total_tokens": 200,
    }
    resumed = TrainerLog(tmp_path, total_steps=4, start_step=2, log_interval=2, steps_per_epoch=None)
    resumed.close()
    assert [
        json.loads(line)["current_steps"]
        for line in (tmp_path / "trainer_log.jsonl").read_text().splitlines()
    ] == [2]


def test_loss_plot_smooths_as_llamafactory(tmp_path: Path) -> None:
    from meshforge.monitor.plot import plot_loss, smooth

    values = [4.0, 2.0, 3.0]
    # LLaMA-Factory's EMA (extras/ploting.py): weight 1.8 * (sigmoid(0.05 * 3) - 0.5) = 0.0673742...
    expected = [4.0, 2.1347484, 2.9417053]
    assert smooth(values) == pytest.approx(expected, rel=1e-6)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(values))
    )
    assert plot_loss(tmp_path).read_bytes()[:4] == b"\x89PNG"


def test_a_hub_id_online_is_fetched_through_huggingface_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No network in tests: huggingface_hub's `snapshot_download` is replaced; the import asks it
    for the id and trains from the folder it returns (or says in one line why not)."""
    import huggingface_hub

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    asked: list[str] = []

    def fetched(repo_id: str, **_kwargs: object) -> str:
        asked.append(repo_id)
        if repo_id == "org/missing":
            raise OSError("404 Client Error: repository not found")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetched)
    lines: list[str] = []
    native = import_llamafactory({"model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507"}, lines.append)
    assert asked == ["Qwen/Qwen3-4B-Instruct-2507"]
    assert native["model"] == {"model_name_or_path": str(tmp_path)}
    assert (
        f"model_name_or_path: 'Qwen/Qwen3-4B-Instruct-2507' is not a local folder: downloaded to {tmp_path}"
        in lines
    )
    with pytest.raises(
        ConfigError, match="'org/missing' is not a local folder, and the hub did not give it: 404"
    ):
        import_llamafactory({"model_name_or_path": "org/missing"})
