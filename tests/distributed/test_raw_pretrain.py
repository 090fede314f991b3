"""MindSpeed-LLM pretraining configs on raw parquet data, launched as MindSpeed's scripts launch them.

The YAMLs are written here in the shape of MindSpeed-LLM's `examples/fsdp2/qwen3*/pretrain_*.yaml`
(grouped keys, `data_manager_type: mg`, the dataset passed on the command line); the models are
tiny stand-ins built from a transformers config, trained from scratch on the bundled tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.utils.resources import resolve_path
from tests.conftest import read_metrics

pytestmark = pytest.mark.slow  # every test here runs meshforge in subprocesses

PARQUET = "train-00000-of-00001-a09b74b3ef9c3b56.parquet"

QWEN3 = """\
model:
  model_id: qwen3
  trust_remote_code: True
  train_from_scratch: True
  tokenizer_name_or_path: ./tiny/
data:
  template: qwen3
  cutoff_len: 64
  overwrite_cache: False
  preprocessing_num_workers: 1
  data_manager_type: mg
  append_eod: True
parallel:
  fsdp_modules:
    - model.layers.{*}
    - model.embed_tokens
    - lm_head
  recompute: False
  param_dtype: fp32
training:
  stage: pt
  disable_shuffling: 1
  seed: 42
  dataloader_drop_last: True
  lr: 1e-04
  lr_scheduler_type: cosine
  warmup_ratio: 0.0
  max_steps: 4
  save_steps: 0
  save_epochs: 0
  logging_steps: 1
"""

QWEN3_MOE = """\
model:
  model_id: qwen3_moe
  trust_remote_code: True
  train_from_scratch: True
  tokenizer_name_or_path: ./tiny/
  init_model_with_meta_device: True
data:
  template: qwen3
  cutoff_len: 64
  max_samples: 100000
  overwrite_cache: True
  preprocessing_num_workers: 1
  data_manager_type: mg
parallel:
  fsdp_modules:
    - model.layers.{*}
    - model.embed_tokens
    - lm_head
  ep_modules:
    - model.layers.{*}.mlp.experts
  ep_fsdp_modules:
    - model.layers.{*}.mlp.experts
  ep_dispatcher: eager
  recompute: False
  reduce_dtype: fp32
  param_dtype: fp32
  cp_size: 1
  cp_type: ulysses
training:
  stage: pt
  dataloader_num_workers: 0
  disable_shuffling: True
  seed: 42
  dataloader_drop_last: True
  optimizer: adamw
  lr: 1e-04
  weight_decay: 0.01
  adam_beta1: 0.9
  adam_beta2: 0.95
  adam_epsilon: 1e-08
  max_grad_norm: 1.0
  lr_scheduler_type: cosine
  warmup_ratio: 0.0
  min_lr: 1e-06
  num_train_epochs: 3.0
  max_steps: 3
  save_steps: 500
  logging_steps: 1
"""


def _stand_in(folder: Path, moe: bool) -> None:
    """A tiny model folder (config.json + the bundled tokenizer) and raw parquet data in `folder`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import transformers

    shutil.copytree(resolve_path("meshforge://assets/tokenizer"), folder / "tiny")
    shape = dict(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if moe:
        config: transformers.PretrainedConfig = transformers.Qwen3MoeConfig(
            **shape, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
    else:
        config = transformers.Qwen3Config(**shape, tie_word_embeddings=True)
    config.save_pretrained(folder / "tiny")
    corpus = resolve_path("meshforge://assets/corpus/python_docstrings.jsonl").read_text(encoding="utf-8")
    texts = [json.loads(line)["text"] for line in corpus.splitlines()[:240]]
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), folder / PARQUET)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def test_raw_parquet_trains_bitwise_as_its_preprocessed_prefix(tmp_path: Path) -> None:
    _stand_in(tmp_path, moe=False)
    (tmp_path / "pt.yaml").write_text(QWEN3, encoding="utf-8")
    train = [sys.executable, "-m", "meshforge", "train", "pt.yaml", "--model.model_name_or_path", "./tiny/"]

    raw = _run(
        [
            *train,
            "--data.dataset",
            json.dumps({"file_name": f"./{PARQUET}"}),
            "--training.output_dir",
            "./raw",
        ],
        tmp_path,
    )
    log = raw.stdout + raw.stderr
    assert "Megatron data: converting" in log and "EOD: appending id 0" in log
    assert "save_steps/save_epochs: 0 and 0 -> no checkpoint is saved" in log
    converted = list(tmp_path.glob("train-*_text_document.bin"))
    assert len(converted) == 1

    again = _run([*train, "--data.dataset", f"./{PARQUET}", "--training.output_dir=./again"], tmp_path)
    assert "reusing" in again.stdout + again.stderr and "converting" not in again.stdout + again.stderr

    _run(
        [
            sys.executable,
            "-m",
            "meshforge",
            "preprocess",
            "--input",
            PARQUET,
            "--output-prefix",
            "pre",
            "--tokenizer",
            "./tiny",
            "--append-eod",
        ],
        tmp_path,
    )
    _run([*train, "--data.dataset", "./pre_text_document", "--training.output_dir", "./prefix"], tmp_path)

    losses = _losses(tmp_path / "raw")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert _losses(tmp_path / "again") == losses
    assert _losses(tmp_path / "prefix") == losses  # bitwise: the same tokens, samples and run
    assert not (tmp_path / "raw" / "checkpoints").exists()


def test_qwen3_moe_launch_line_under_torchrun(tmp_path: Path) -> None:
    """`pretrain_qwen3_30b_4k_fsdp2_A3.sh`'s torchrun arguments and overrides, `train_fsdp2.py`
    replaced by `-m meshforge train`, on 2 CPU processes (gloo). Its kernel switches stay `True`:
    those the CPU has not are warned no-ops, so the line runs unchanged apart from the script."""
    _stand_in(tmp_path, moe=True)
    (tmp_path / "pretrain_qwen3_30b_4k_fsdp2_A3.yaml").write_text(QWEN3_MOE, encoding="utf-8")
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--node_rank",
        "0",
        "--master_addr",
        "localhost",
        "--master_port",
        str(_free_port()),
        "-m",
        "meshforge",
        "train",
        "pretrain_qwen3_30b_4k_fsdp2_A3.yaml",
        "--model.model_name_or_path",
        "./tiny/",
        "--data.dataset",
        json.dumps({"file_name": f"./{PARQUET}"}),
        "--parallel.fsdp_size",
        "16",
        "--parallel.ep_size",
        "1",
        "--parallel.ep_fsdp_size",
        "1",
        "--training.per_device_train_batch_size",
        "1",
        "--training.gradient_accumulation_steps",
        "1",
        "--training.output_dir",
        "./output",
        "--optimization.use_fused_rmsnorm",
        "True",
        "--optimization.use_fused_rotary_pos_emb",
        "True",
        "--optimization.moe_grouped_gemm",
        "True",
        "--optimization.use_flash_attn",
        "True",
    ]
    proc = _run(launch, tmp_path)
    log = proc.stdout + proc.stderr
    # rank 0 converts, once; rank 1 waits and reads the same prefix
    assert log.count("Megatron data: converting") == 1, log
    assert "[rank1]" not in [line.split(" ", 1)[0] for line in log.splitlines() if "converting" in line]
    assert "world=2" in log and "global batch 2 = dp 2 x local 1" in log
    # The launch line's accelerator kernels are warned no-ops on the CPU, not errors.
    assert "warning: kernels.use_flash_attn: true has no effect here" in log
    assert "warning: kernels.use_fused_rotary_pos_emb: true has no effect here" in log
    records = read_metrics(tmp_path / "output")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 8.0 for r in records)  # ~ln(8192) at init
    assert (tmp_path / "output" / "checkpoints" / "checkpoint-00000003" / "COMPLETE").is_file()
