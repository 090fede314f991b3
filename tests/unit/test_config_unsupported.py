"""The "not supported yet" list: silent for the defaults, each entry fires on its own key path."""

from __future__ import annotations

import json

import pytest

from meshforge.config import ConfigError, TrainConfig, check_trainable, config_from_dict, unsupported_features
from meshforge.config.unsupported import ENTRIES

# A minimal config that turns each entry's feature on (validity rules satisfied).
TRIGGERS: dict[str, dict] = {
    "parallelism.expert_parallel_async_d2h": {"parallelism": {"expert_parallel_async_d2h": True}},
    "parallelism.context_parallel_async": {"parallelism": {"context_parallel_async": True}},
    "parallelism.pipeline_parallel_overlap_p2p": {"parallelism": {"pipeline_parallel_overlap_p2p": True}},
    "parallelism.pipeline_parallel_overlap_b_f": {"parallelism": {"pipeline_parallel_overlap_b_f": True}},
    "parallelism.enable_mc2": {"parallelism": {"enable_mc2": True}},
    "parallelism.data_parallel_shard_strategy": {"parallelism": {"data_parallel_shard_strategy": "optim"}},
    "parallelism.tp_colwise": {"parallelism": {"tp_colwise": ["*.q_proj"]}},
    "parallelism.tp_rowwise": {"parallelism": {"tp_rowwise": ["*.o_proj"]}},
    "parallelism.ep_dispatcher": {"parallelism": {"ep_dispatcher": "fused"}},
    "model.model_revision": {"model": {"model_revision": "v1.0"}},
    "model.cache_dir": {"model": {"cache_dir": "./hub"}},
    "model.hf_hub_token": {"model": {"hf_hub_token": "hf_x"}},
    "model.ms_hub_token": {"model": {"ms_hub_token": "ms_x"}},
    "model.om_hub_token": {"model": {"om_hub_token": "om_x"}},
    "training.indexer_loss_coeff": {"training": {"indexer_loss_coeff": 0.5}},
    "parallelism.pipeline_parallel_p2p_transport": {
        "parallelism": {"pipeline_parallel_p2p_transport": "hccs"}
    },
    "parallelism.pipeline_parallel_microbatch_size": {
        "parallelism": {"pipeline_parallel": 2, "pipeline_parallel_microbatch_size": 4}
    },
    "parallelism.sequence_parallel": {"parallelism": {"tensor_parallel": 2, "sequence_parallel": False}},
    "kernels.use_triton_gdn": {"kernels": {"use_triton_gdn": True}},
    "kernels.use_flash_gdn": {"kernels": {"use_flash_gdn": True}},
    "kernels.use_triton_rmsnormgated": {"kernels": {"use_triton_rmsnormgated": True}},
    "kernels.use_ascend_mhc": {"model": {"model_id": "deepseek_v4"}, "kernels": {"use_ascend_mhc": True}},
    "kernels.use_triton_swiglu_limit": {
        "model": {"model_id": "deepseek_v4"},
        "kernels": {"use_triton_swiglu_limit": True},
    },
    "checkpoint.remove_redundancy": {"checkpoint": {"remove_redundancy": True}},
    "checkpoint.save_epochs": {"checkpoint": {"save_epochs": 1}},
    "checkpoint.load_worker_number": {"checkpoint": {"load_worker_number": 4}},
    "checkpoint.reshard_worker_num": {"checkpoint": {"reshard_worker_num": 2}},
    # SFT data fields under train_dataset.
    "train_dataset.template": {"train_dataset": {"template": "qwen3"}},
    "train_dataset.dataset": {"train_dataset": {"dataset": "alpaca"}},
    "train_dataset.eval_dataset": {"train_dataset": {"eval_dataset": "dev"}},
    "train_dataset.dataset_dir": {"train_dataset": {"dataset_dir": "./data"}},
    "train_dataset.cutoff_len": {"train_dataset": {"cutoff_len": 1024}},
    "train_dataset.train_on_prompt": {"train_dataset": {"train_on_prompt": True}},
    "train_dataset.mask_history": {"train_dataset": {"mask_history": True}},
    "train_dataset.streaming": {"train_dataset": {"streaming": True}},
    "train_dataset.buffer_size": {"train_dataset": {"buffer_size": 10}},
    "train_dataset.mix_strategy": {"train_dataset": {"mix_strategy": "interleave_over"}},
    "train_dataset.interleave_probs": {
        "train_dataset": {"dataset": "a,b", "mix_strategy": "interleave_under", "interleave_probs": "0.5,0.5"}
    },
    "train_dataset.overwrite_cache": {"train_dataset": {"overwrite_cache": True}},
    "train_dataset.preprocessing_batch_size": {"train_dataset": {"preprocessing_batch_size": 10}},
    "train_dataset.preprocessing_num_workers": {"train_dataset": {"preprocessing_num_workers": 2}},
    "train_dataset.max_samples": {"train_dataset": {"max_samples": 5}},
    "train_dataset.ignore_pad_token_for_loss": {"train_dataset": {"ignore_pad_token_for_loss": False}},
    "train_dataset.val_size": {"train_dataset": {"dataset": "a", "val_size": 0.1}},
    "train_dataset.eval_on_each_dataset": {"train_dataset": {"eval_on_each_dataset": True}},
    "train_dataset.packing": {"train_dataset": {"packing": True}},
    "train_dataset.neat_packing": {"train_dataset": {"neat_packing": True}},
    "train_dataset.tool_format": {"train_dataset": {"tool_format": "qwen"}},
    "train_dataset.default_system": {"train_dataset": {"default_system": "Be brief."}},
    "train_dataset.enable_thinking": {"train_dataset": {"enable_thinking": False}},
    "train_dataset.tokenized_path": {"train_dataset": {"tokenized_path": "./tok"}},
    "train_dataset.data_shared_file_system": {"train_dataset": {"data_shared_file_system": True}},
    "train_dataset.reset_attention_mask": {
        "train_dataset": {"reset_attention_mask": True, "append_eod": True}
    },
    "training.pref_beta": {"training": {"pref_beta": 0.2}},
    "training.pref_loss": {"training": {"pref_loss": "ipo"}},
    "training.pref_ftx": {"training": {"pref_ftx": 0.1}},
    "training.dpo_label_smoothing": {"training": {"dpo_label_smoothing": 0.1}},
    "training.simpo_gamma": {"training": {"simpo_gamma": 1.0}},
    "training.pref_ref_logps": {"training": {"pref_ref_logps": "precompute"}},
}


_DPO = {
    "training": {"stage": "dpo"},
    "train_dataset": {"dataloader": {"type": "SFTDataLoader"}, "dataset": "dpo_demo"},
}
_PRECOMPUTE = {**_DPO, "training": {"stage": "dpo", "pref_ref_logps": "precompute"}}
# What training.stage: dpo does not combine with yet.
DPO_TRIGGERS: list[tuple[str, dict]] = [
    (
        "parallelism.fault_tolerance.enable",
        {**_DPO, "parallelism": {"fault_tolerance": {"enable": True, "replica_groups": 2}}},
    ),
    *[
        ("training.pref_ref_logps", {**_PRECOMPUTE, **extra})
        for extra in (
            {"train_dataset": {**_DPO["train_dataset"], "streaming": True}},
            {"parallelism": {"context_parallel": 2}},
            {"parallelism": {"pipeline_parallel": 2}},
            {"parallelism": {"fault_tolerance": {"enable": True, "replica_groups": 2}}},
        )
    ],
]


@pytest.mark.parametrize("path,raw", DPO_TRIGGERS, ids=[p for p, _ in DPO_TRIGGERS])
def test_dpo_refuses_what_it_does_not_combine_with(path, raw):
    cfg = config_from_dict(raw)
    notes = [e.note for e in ENTRIES if e.path == path and e.is_set(cfg)]
    assert path in unsupported_features(cfg) and any("training.stage: dpo" in n for n in notes)
    assert "training.stage" not in unsupported_features(cfg)  # dpo itself trains


def test_default_config_has_no_unsupported_features():
    assert unsupported_features(TrainConfig()) == []


_RM = {**_DPO, "training": {"stage": "rm"}}
# What training.stage: rm does not combine with yet.
RM_TRIGGERS: list[tuple[str, dict]] = [
    ("parallelism.context_parallel", {**_RM, "parallelism": {"context_parallel": 2}}),
    ("parallelism.pipeline_parallel", {**_RM, "parallelism": {"pipeline_parallel": 2}}),
    (
        "parallelism.fault_tolerance.enable",
        {**_RM, "parallelism": {"fault_tolerance": {"enable": True, "replica_groups": 2}}},
    ),
]


@pytest.mark.parametrize("path,raw", RM_TRIGGERS, ids=[p for p, _ in RM_TRIGGERS])
def test_rm_refuses_what_it_does_not_combine_with(path, raw):
    cfg = config_from_dict(raw)
    notes = [e.note for e in ENTRIES if e.path == path and e.is_set(cfg)]
    assert path in unsupported_features(cfg) and any("training.stage: rm" in n for n in notes)
    assert unsupported_features(config_from_dict(_RM)) == []  # rm itself trains


def test_every_entry_has_a_trigger():
    triggers = [*TRIGGERS, *(p for p, _ in DPO_TRIGGERS), *(p for p, _ in RM_TRIGGERS)]
    assert sorted(triggers) == sorted(entry.path for entry in ENTRIES)


@pytest.mark.parametrize("path", sorted(TRIGGERS))
def test_entry_fires_on_its_key(path):
    cfg = config_from_dict(TRIGGERS[path])
    assert path in unsupported_features(cfg)


def test_defaults_written_out_are_not_features():
    cfg = config_from_dict(
        {
            "parallelism": {
                "fsdp_modules": ["model.layers.{}", "model.embed_tokens", "lm_head"],
                "tensor_parallel": 1,
            },
            "inference": {"max_new_tokens": 512},
            "monitor": {"train_state": {"local_loss": False}},
            "recompute": {"mode": "None"},
            "model": {"compute_dtype": "bf16"},
        }
    )
    assert unsupported_features(cfg) == []


def test_check_trainable_refuses_with_key_path():
    cfg = config_from_dict(
        {
            "model": {"model_type": "qwen3"},
            "train_dataset": {
                "dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}
            },
            "parallelism": {"enable_mc2": True},
            "lora_config": {"target_modules": ".*q_proj"},
        }
    )
    with pytest.raises(ConfigError) as info:
        check_trainable(cfg)
    text = str(info.value)
    assert "error: parallelism.enable_mc2: not supported yet: parallelism.enable_mc2" in text
    assert "lora_config" not in text  # built: adapters are trained


def test_check_trainable_needs_a_model_and_a_loader():
    with pytest.raises(ConfigError) as info:
        check_trainable(TrainConfig())
    paths = [p for p, _ in info.value.issues]
    assert "model" in paths and "train_dataset.dataloader.type" in paths
    assert "no model given: set model.model_type (e.g. qwen3) or model.model_name_or_path" in str(info.value)


def test_check_trainable_reports_unknown_passthrough_key():
    pytest.importorskip("meshforge.models.registry")
    cfg = config_from_dict(
        {
            "model": {"model_type": "qwen3", "num_hiden_layers": 2},
            "train_dataset": {
                "dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}
            },
        }
    )
    with pytest.raises(ConfigError) as info:
        check_trainable(cfg)
    assert "model.num_hiden_layers" in [p for p, _ in info.value.issues]
    assert "num_hidden_layers" in str(info.value)


def test_check_trainable_layers_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    cfg = config_from_dict(
        {
            "model": {"model_name_or_path": str(tmp_path)},
            "recompute": {"mode": "full", "full_recompute_layer": ["0-3"]},
        }
    )
    with pytest.raises(ConfigError) as info:
        check_trainable(cfg)
    assert any(
        p == "recompute.full_recompute_layer[0]" and "out of range [0, 1]" in r for p, r in info.value.issues
    )


def test_built_optimizer_spellings_are_not_refused() -> None:
    # The importer writes MindSpeed's `adamw` / `fused_adamw`; both are built.
    for name in ("AdamW", "adamw", "FusedAdamW"):
        cfg = config_from_dict({"optimizer": {"type": name}})
        assert "optimizer.type" not in unsupported_features(cfg), name


def test_sft_fields_are_accepted_with_the_sft_loader():
    sft = {
        "template": "qwen3",
        "dataset": "a,b",
        "cutoff_len": 1024,
        "packing": True,
        "mix_strategy": "interleave_under",
        "interleave_probs": "0.5,0.5",
        "tokenized_path": "./tok",
    }
    cfg = config_from_dict(
        {"training": {"stage": "sft"}, "train_dataset": {"dataloader": {"type": "SFTDataLoader"}, **sft}}
    )
    assert unsupported_features(cfg) == []
    # With another loader the same keys would be ignored, so they are refused there.
    other = config_from_dict({"train_dataset": {"dataloader": {"type": "TextDataLoader"}, **sft}})
    assert "train_dataset.template" in unsupported_features(other)
    # Built (streaming, validation split), so accepted with the SFT loader.
    streaming = config_from_dict(
        {
            "train_dataset": {
                "dataloader": {"type": "SFTDataLoader"},
                "dataset": "a",
                "streaming": True,
                "val_size": 4,
            }
        }
    )
    assert unsupported_features(streaming) == []
    # Per-dataset evaluation: read by the SFT loader, refused with another (it would be ignored).
    each = {"eval_dataset": "a,b", "eval_on_each_dataset": True}
    sft_each = config_from_dict({"train_dataset": {"dataloader": {"type": "SFTDataLoader"}, **each}})
    assert unsupported_features(sft_each) == []
    text_each = config_from_dict({"train_dataset": {"dataloader": {"type": "TextDataLoader"}, **each}})
    assert "train_dataset.eval_on_each_dataset" in unsupported_features(text_each)
    # The beams of `meshforge generate`: accepted (a warned no-op in training) with any loader.
    beams = config_from_dict({"train_dataset": {"eval_num_beams": 4}})
    assert unsupported_features(beams) == []


@pytest.mark.parametrize(("model_type", "refused"), [("mistral", False), ("qwen3", True)])
def test_custom_tp_plan_only_on_the_generic_path(tmp_path, model_type, refused):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    cfg = config_from_dict(
        {
            "model": {"model_name_or_path": str(tmp_path)},
            "parallelism": {
                "tp_colwise": ["*.q_proj", "lm_head"],
                "tp_rowwise": ["*.o_proj", "model.embed_tokens"],
            },
        }
    )
    found = {"parallelism.tp_colwise", "parallelism.tp_rowwise"} & set(unsupported_features(cfg))
    assert bool(found) == refused


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        (
            {"checkpoint": {"load_balanced": True}},
            "checkpoint.load_balanced",
            "reads in parallel on every rank",
        ),
        (
            {"train_dataset": {"create_attention_mask_in_dataloader": True}},
            "train_dataset.create_attention_mask_in_dataloader",
            "carry segment_ids",
        ),
    ],
)
def test_seed_keys_without_an_effect_are_warned_with_the_reason(data, path, words) -> None:
    from meshforge.config.noops import noop_notes

    cfg = config_from_dict(data)
    assert path not in unsupported_features(cfg)
    notes = dict(noop_notes(cfg, "cpu"))
    assert words in notes[path]
