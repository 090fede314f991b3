"""Megatron flags -> native config: each read flag logged, the model from the flags or --load's
config.json (a disagreement names the flag and both values), MoE / MLA / MTP, module names, data,
schedule and outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.config.base import ConfigError
from meshforge.config.loader import validate_imported
from meshforge.config.megatron_import import import_megatron

TOKENIZER = str(Path(__file__).resolve().parents[2] / "assets" / "tokenizer")
DENSE = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--max-position-embeddings", "128",
    "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", TOKENIZER,
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-4",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
]  # fmt: skip


def _import(flags: list[str]) -> tuple[dict, list[str]]:
    lines: list[str] = []
    origins: dict[str, tuple[str, object]] = {}
    data = import_megatron(flags, lines.append, origins)
    validate_imported(data, origins)  # the result is a valid native config
    return data, lines


def test_dense_qwen3_from_flags_with_megatron_defaults_and_log_lines():
    data, lines = _import(
        [*DENSE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-mcore-models"]
    )
    model = data["model"]
    assert model["model_type"] == "qwen3" and model["num_key_value_heads"] == 2 and model["head_dim"] == 16
    assert model["vocab_size"] == 8192 * 1  # the tokenizer's 8192 ids, a multiple of 128 x tp 2
    assert model["tie_word_embeddings"] is True and model["rope_theta"] == 1e6
    assert "--tensor-model-parallel-size 2 -> parallelism.tensor_parallel: 2" in lines
    assert data["parallelism"]["sequence_parallel"] is True
    # Megatron's defaults where they differ from meshforge's
    assert data["training"]["seed"] == 1234 and data["optimizer"]["betas"] == [0.9, 0.999]
    assert data["lr_scheduler"]["type"] == "LinearWithWarmUpLR" and data["optimizer"]["weight_decay"] == 0.01
    assert any(
        line.startswith("--seed not given -> training.seed: 1234 (Megatron's default)") for line in lines
    )
    assert any("--use-mcore-models" in line for line in lines) or "--use-mcore-models" not in data
    assert data["checkpoint"]["enable_save"] is False  # no --save: no checkpoint, as in Megatron


def test_llama_when_no_qk_layernorm_and_moe_and_mla_families():
    flags = [f for f in DENSE if f != "--qk-layernorm"]
    assert _import(flags)[0]["model"]["model_type"] == "llama"
    moe, _ = _import(
        [*DENSE, "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--first-k-dense-replace", "1",
         "--moe-aux-loss-coeff", "0.01", "--norm-topk-prob", "--expert-model-parallel-size", "2"]
    )  # fmt: skip
    assert moe["model"]["model_type"] == "qwen3_moe" and moe["model"]["num_experts"] == 8
    assert moe["model"]["mlp_only_layers"] == [0] and moe["model"]["norm_topk_prob"] is True
    assert moe["training"]["router_aux_loss_coef"] == 0.01 and moe["parallelism"]["expert_parallel"] == 2
    # Megatron's router renormalises the top-k unless --moe-router-pre-softmax
    base = [*DENSE, "--num-experts", "8", "--moe-router-topk", "2"]
    assert _import(base)[0]["model"]["norm_topk_prob"] is True
    assert _import([*base, "--moe-router-pre-softmax"])[0]["model"]["norm_topk_prob"] is False
    mla_flags = [f for f in DENSE if f not in ("--qk-layernorm",)]
    mla, _ = _import(
        [*mla_flags, "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-layer-freq", "[0]*1+[1]*1", "--moe-shared-expert-intermediate-size", "32", "--moe-ffn-hidden-size", "32",
         "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "2",
         "--moe-router-group-topk", "1", "--mtp-num-layers", "1"]
    )  # fmt: skip
    model = mla["model"]
    assert (
        model["model_type"] == "deepseek_v3"
        and model["qk_rope_head_dim"] == 8
        and model["kv_lora_rank"] == 16
    )
    assert (
        model["first_k_dense_replace"] == 1
        and model["n_shared_experts"] == 1
        and model["n_routed_experts"] == 4
    )
    assert model["num_nextn_predict_layers"] == 1 and mla["training"]["mtp_loss_scaling_factor"] == 0.1


def test_unbuilt_model_flags_are_named():
    with pytest.raises(ConfigError) as err:
        import_megatron(
            [f for f in DENSE if f not in ("--swiglu", "--disable-bias-linear")]
            + ["--normalization", "LayerNorm"]
        )
    text = str(err.value)
    assert (
        "--swiglu: not supported yet" in text
        and "--normalization: not supported yet: --normalization LayerNorm" in text
    )
    assert "--disable-bias-linear: not supported yet: linear biases in qwen3" in text


def _hf_folder(path: Path, **changes: object) -> Path:
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 8192, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True}  # fmt: skip
    config.update(changes)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_load_of_a_hf_folder_must_agree_with_the_flags(tmp_path: Path):
    folder = _hf_folder(tmp_path / "hf")
    data, lines = _import([*DENSE, "--load", str(folder)])
    assert data["model"]["model_name_or_path"] == str(folder) and "model_type" not in data["model"]
    other = _hf_folder(tmp_path / "hf2", hidden_size=96)
    with pytest.raises(ConfigError) as err:
        import_megatron([*DENSE, "--load", str(other)])
    assert f"--hidden-size: --hidden-size gives hidden_size 64 but {other}/config.json has 96" in str(
        err.value
    )
    with pytest.raises(
        ConfigError, match="--model-type-hf gives the family 'llama' but .*config.json has model_type 'qwen3'"
    ):
        import_megatron([*DENSE, "--model-type-hf", "llama3", "--load", str(folder)])
    # the family comes from config.json when no --spec / --model-type-hf names it
    llama = _hf_folder(tmp_path / "llama", model_type="llama")
    with pytest.raises(ConfigError, match="llama has no q/k norm: drop --qk-layernorm"):
        import_megatron([*DENSE, "--load", str(llama)])


def test_module_names_data_schedule_recompute_and_outputs(tmp_path: Path):
    save = tmp_path / "ckpt"
    data, lines = _import(
        [*DENSE, "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "linear_qkv", "linear_proj",
         "linear_fc1", "linear_fc2", "--data-path", "0.3", "a_text_document", "0.7", "b_text_document",
         "--split", "98,2,0", "--seq-length", "64", "--eod-mask-loss", "--reset-position-ids", "--eval-interval", "5",
         "--eval-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-5", "--lr-warmup-fraction", "0.1",
         "--lr-decay-iters", "8", "--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "1", "--save", str(save), "--load", str(save), "--save-interval", "5", "--bf16"]
    )  # fmt: skip
    assert data["lora_config"]["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    cfg = data["train_dataset"]["dataloader"]["config"]
    assert cfg["data_path"] == ["0.3", "a_text_document", "0.7", "b_text_document"]
    assert (
        cfg["eod_mask_loss"] is True and cfg["reset_position_ids"] is True and cfg["eod"] == 2
    )  # <|im_end|>
    assert data["training"]["eval_interval"] == 5 and data["training"]["eval_iters"] == 2
    assert data["train_dataset"]["dataloader"]["sizes"] == [0, (10 // 5 + 1) * 2 * 8, 2 * 8]
    assert data["lr_scheduler"] == {"learning_rate": 1e-4, "type": "CosineWithWarmUpLR", "warmup_steps": 0, "min_lr": 1e-5, "decay_steps": 8} | {"warmup_steps": 0}  # fmt: skip
    assert data["recompute"] == {"mode": "full", "full_recompute_layer": ["0"]}
    assert data["training"]["output_dir"] == str(save) and data["checkpoint"]["load_path"] == "auto"
    assert any("beside the checkpoints" in line for line in lines)
    assert data["model"]["compute_dtype"] == "bfloat16"


def test_a_value_with_no_flag_and_a_switch_given_a_value_are_errors():
    with pytest.raises(ConfigError) as err:
        import_megatron([*DENSE, "stray", "--swiglu=1"])
    assert "stray: a value with no flag before it" in str(err.value) and "--swiglu: takes no value" in str(
        err.value
    )


def test_run_length_and_schedule_in_samples():
    flags = [f for f in DENSE]
    at = flags.index("--train-iters")
    del flags[at : at + 2]
    data, lines = _import(
        [*flags, "--data-path", "corpus_text_document", "--seq-length", "32", "--train-samples", "100", "--lr-warmup-samples", "16", "--lr-decay-samples", "80", "--lr-decay-style", "cosine"]
    )  # fmt: skip
    assert data["training"]["steps"] == 12  # 100 // 8, as Megatron's update_train_iters
    # Megatron's default split 969,30,1 and --eval-iters 100: valid (12 // 1000 + 1) x 100 x 8 samples
    assert data["train_dataset"]["dataloader"]["sizes"] == [100, 800, 800]
    assert data["lr_scheduler"]["warmup_steps"] == 2 and data["lr_scheduler"]["decay_steps"] == 10


def test_a_family_without_modules_here_trains_through_transformers_from_its_folder(tmp_path: Path):
    """Megatron's Mixtral flags with --load of a Mixtral HF folder: the generic path, sizes checked."""
    flags = [f for f in DENSE if f != "--qk-layernorm"] + ["--num-experts", "4", "--moe-router-topk", "2"]
    folder = _hf_folder(
        tmp_path / "mixtral", model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4
    )
    data, lines = _import([*flags, "--load", str(folder)])
    model = {
        "tokenizer_name_or_path": TOKENIZER,
        "model_name_or_path": str(folder),
        "compute_dtype": "float32",
    }
    assert data["model"] == model
    assert any("transformers' model (the generic path)" in line for line in lines)
    other = _hf_folder(tmp_path / "mixtral8", model_type="mixtral", num_local_experts=8)
    with pytest.raises(ConfigError, match="--num-experts gives num_local_experts 4 but .*config.json has 8"):
        import_megatron([*flags, "--load", str(other)])
