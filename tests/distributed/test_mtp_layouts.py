"""DeepSeek-V3 with YaRN and one MTP block: dp2 (FSDP) with ep2, tp2 (+SP) and pp2 equal one process.

One process runs `meshforge train` for 3 steps; one spawn of 2 gloo ranks then builds the real
`Trainer` from the same config three times (FSDP over 2 data ranks with the experts split over
them; tensor parallel 2; pipeline parallel 2, the MTP block on the last stage) and each must log
the same `loss`, `mtp_loss` and `grad_norm` (deterministic mode, relative 1e-5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

CONFIG = """
training:
  steps: 3
  local_batch_size: 2
  global_batch_size: 4
  seed: 7
  deterministic: true
  log_interval: 1
  mtp_loss_scaling_factor: 0.5
optimizer:
  type: AdamW
lr_scheduler:
  type: ConstantWarmUpLR
  learning_rate: 1.e-2
  warmup_steps: 0
train_dataset:
  dataloader:
    type: TextDataLoader
    data_path: meshforge://assets/corpus/python_docstrings.jsonl
    text_key: text
    seq_length: 32
checkpoint:
  enable_save: false
model:
  model_type: deepseek_v3
  tokenizer_name_or_path: meshforge://assets/tokenizer
  compute_dtype: float32
  flavor: debug
  hidden_size: 32
  intermediate_size: 64
  moe_intermediate_size: 16
  num_hidden_layers: 2
  num_nextn_predict_layers: 1
  tie_word_embeddings: false
  rope_parameters:
    {rope_type: yarn, rope_theta: 10000.0, factor: 4.0, original_max_position_embeddings: 16, mscale: 1.0,
     mscale_all_dim: 1.0}
"""
LAYOUTS = {
    # FSDP over the 2 data ranks, the routed experts split over them (ep 2 of dp_shard 2).
    "dp2_ep2": ["--parallelism.expert_parallel=2"],
    "tp2": ["--parallelism.tensor_parallel=2"],
    # The MTP block on the last stage with its own copy of the (untied) embedding.
    "pp2": ["--parallelism.pipeline_parallel=2"],
}


def _worker(rank: int, world: int, root: str) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    config = Path(root) / "mtp.yaml"
    for name, extra in LAYOUTS.items():
        cfg = load_config(config, [*extra, f"--training.output_dir={root}/{name}"])
        trainer = Trainer(cfg, log=lambda _line: None)
        trainer.setup()
        trainer.train()
        trainer.close()


def test_mtp_layouts_equal_one_process(tmp_path: Path) -> None:
    (tmp_path / "mtp.yaml").write_text(CONFIG)
    train_one(tmp_path / "mtp.yaml", [f"--training.output_dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = read_metrics(tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3] and all(r["mtp_loss"] > 0 for r in one)
    run_workers(_worker, 2, str(tmp_path))
    for name in LAYOUTS:
        got = read_metrics(tmp_path / name)
        assert len(got) == 3, name
        for a, b in zip(one, got, strict=True):
            for key in ("loss", "mtp_loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (name, key, json.dumps(b))
