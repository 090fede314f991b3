"""`meshforge config import` on YAMLs in the shapes of MindSpeed-LLM's FSDP2 examples and tests.

Written here (not copied): one small YAML per kind of file that MindSpeed-LLM ships under
`examples/fsdp2/**` and its FSDP2 test folders (August 2026), with their paths pointed at local
stand-ins. Each must import with exit 0, or exit 2 with every error a `not supported yet` that
names a key; and every key of the file must appear in the import report or in an error.
"""

from __future__ import annotations

import pytest
import yaml

from meshforge.cli.config import main

FSDP = """\
parallel:
  fsdp_modules:
    - model.layers.{*}
    - model.embed_tokens
    - lm_head
  recompute: True
  recompute_modules:
    - model.layers.{*}
"""
EP = """\
  ep_modules:
    - model.layers.{*}.mlp.experts
  ep_fsdp_modules:
    - model.layers.{*}.mlp.experts
  ep_dispatcher: eager
"""
OPTIM = """\
  optimizer: adamw
  lr: 1e-05
  weight_decay: 0.01
  adam_beta1: 0.9
  adam_beta2: 0.95
  adam_epsilon: 1e-08
  max_grad_norm: 1.0
  lr_scheduler_type: cosine
  warmup_ratio: 0.0
  min_lr: 1e-06
  max_steps: 20
  logging_steps: 1
"""


def _pretrain(model_id: str | None, *, extra_model="", extra_parallel="", extra_training="", optimization=""):
    model = "model:\n" + (f"  model_id: {model_id}\n" if model_id else "") + "  model_name_or_path: ./tiny/\n"
    return (
        model
        + "  trust_remote_code: True\n  train_from_scratch: False\n  init_model_with_meta_device: True\n"
        + extra_model
        + "data:\n  template: qwen3\n  cutoff_len: 4096\n  max_samples: 100000\n  overwrite_cache: True\n"
        + "  preprocessing_num_workers: 1\n  data_manager_type: mg\n"
        + '  dataset: {file_name: "./train.parquet"}\n'
        + FSDP
        + EP
        + extra_parallel
        + "training:\n  stage: pt\n  output_dir: ./out\n  dataloader_num_workers: 4\n  seed: 42\n"
        + "  dataloader_drop_last: True\n"
        + OPTIM
        + extra_training
        + (f"optimization:\n{optimization}" if optimization else "")
    )


def _tune(model_id: str | None, template: str, extra_data="", extra_training=""):
    model = "model:\n" + (f"  model_id: {model_id}\n" if model_id else "") + "  model_name_or_path: ./tiny/\n"
    return (
        model
        + "  trust_remote_code: False\n  train_from_scratch: False\n"
        + f"data:\n  template: {template}\n  cutoff_len: 4096\n  max_samples: 100000\n"
        + "  overwrite_cache: True\n  preprocessing_num_workers: 1\n"
        + '  dataset: {file_name: "./alpaca.json", formatting: alpaca}\n'
        + extra_data
        + FSDP
        + "  cp_size: 1\n  cp_type: ulysses\n"
        + "training:\n  output_dir: ./out\n  dataloader_num_workers: 1\n  dataloader_drop_last: True\n"
        + OPTIM
        + extra_training
    )


SAVE_NONE = "  save_steps: 0\n  save_epochs: 0\n"
KERNELS = "  use_fused_rmsnorm: True\n  use_fused_rotary_pos_emb: True\n  use_flash_attn: True\n"

SHAPES = {
    "qwen3_pretrain_A2": _pretrain(None, extra_training="  save_steps: 500\n"),
    "qwen3_pretrain_A3": _pretrain(
        "qwen3", extra_training="  save_steps: 500\n  save_epochs: 1\n", optimization=KERNELS
    ),
    "qwen3_tune": _tune(None, "qwen3", extra_training="  disable_shuffling: True\n  save_steps: 500\n"),
    "qwen3_moe_pretrain": _pretrain(
        "qwen3_moe",
        extra_parallel="  reduce_dtype: bf16\n  cp_size: 1\n  cp_type: ulysses\n",
        extra_training="  disable_shuffling: True\n  num_train_epochs: 3.0\n  save_steps: 500\n",
        optimization=KERNELS + "  moe_grouped_gemm: True\n",
    ),
    "qwen3_moe_st": _pretrain("qwen3_moe", extra_training=SAVE_NONE),
    "qwen3_next_pretrain": _pretrain(
        "qwen3_next",
        extra_training="  save_steps: 500\n",
        optimization="  use_triton_gdn: True\n  gdn_chunk_size: 64\n",
    ),
    "qwen3_next_tune": _tune("qwen3_next", "qwen3", extra_data="  packing: True\n"),
    "gpt_oss_tune_varlen": _tune(
        "gpt_oss", "gpt", extra_data="  neat_packing: True\n", extra_training="  disable_shuffling: 1\n"
    ),
    "gpt_oss_st": _tune("gpt_oss", "gpt", extra_training="  disable_shuffling: 1\n" + SAVE_NONE),
    "qwen3_8b_st": _pretrain(None, extra_training=SAVE_NONE + "  disable_shuffling: 0\n"),
    "deepseek_v4": _pretrain(
        "deepseek_v4",
        extra_parallel="  fsdp_implementation: custom\n",
        extra_training="  disable_shuffling: 1\n  save_steps: 0\n",
        optimization="  use_ascend_mhc: True\n  use_triton_swiglu_limit: True\n",
    ),
    "glm52": _pretrain(
        "glm52",
        extra_training="  disable_shuffling: 1\n  indexer_loss_coeff: 1.0\n" + SAVE_NONE,
        optimization="  use_sparse_flash_attn: True\n  use_fused_lightning_indexer: True\n",
    ),
    "longcat_flash": _pretrain("longcat_flash_ngram", extra_training=SAVE_NONE),
    "mamba3": _pretrain("mamba3", extra_training="  disable_shuffling: 1\n" + SAVE_NONE),
    "minimax_m27": _pretrain("minimax_m27", extra_training=SAVE_NONE + "  save_hf_weights: False\n"),
    "step35": _pretrain("step35", extra_training="  disable_shuffling: 1\n  save_steps: 2000\n"),
}


def _keys(text: str) -> list[str]:
    data = yaml.safe_load(text)
    return [key for group in data.values() for key in group]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shape_imports_or_names_what_is_not_built(tmp_path, capsys, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(SHAPES[name], encoding="utf-8")
    code = main(["import", str(path), "-o", str(tmp_path / "native.yaml")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    if code == 0:
        assert not errors and (tmp_path / "native.yaml").is_file()
    else:
        assert code == 2 and errors
        assert all("not supported yet: " in line for line in errors), errors
    report = [line.removeprefix("import: ") for line in err.splitlines()]
    for key in _keys(SHAPES[name]):
        assert any(key in line.split(" -> ")[0].split(" = ")[0].split(":")[0] for line in report) or any(
            key in line for line in errors
        ), f"{key} is not in the import report of {name}:\n{err}"


def test_the_shapes_that_build_import_and_the_others_say_why(tmp_path, capsys):
    built = {"qwen3_pretrain_A2", "qwen3_pretrain_A3", "qwen3_tune", "qwen3_moe_pretrain", "qwen3_moe_st"}
    built |= {"qwen3_next_pretrain", "qwen3_next_tune", "gpt_oss_tune_varlen", "gpt_oss_st", "qwen3_8b_st"}
    built |= {"minimax_m27", "step35", "mamba3"}
    codes = {}
    for name, text in SHAPES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        codes[name] = main(["import", "-q", str(path), "-o", str(tmp_path / f"{name}.native.yaml")])
    capsys.readouterr()
    assert {name for name, code in codes.items() if code == 0} == built
