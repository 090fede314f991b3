"""`config validate --world-size N` plans any layout without processes: mesh, batch, memory."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from meshforge.config import load_config
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.plan import count_parameters, plan_lines, stage_layers

BIG = """
model:
  model_type: qwen3
  hidden_size: 4096
  intermediate_size: 12288
  num_hidden_layers: 36
  num_attention_heads: 32
  num_key_value_heads: 8
  head_dim: 128
  vocab_size: 151936
  tie_word_embeddings: false
  tokenizer_name_or_path: meshforge://assets/tokenizer
train_dataset:
  dataloader: {type: TextDataLoader, data_path: corpus.txt, seq_length: 4096}
training: {global_batch_size: 1024, local_batch_size: 1}
parallelism: {tensor_parallel: 4, pipeline_parallel: 4, context_parallel: 2, data_parallel_shard: 16}
"""


def _dims(world, tp=1, cp=1, pp=1, ep=1, shard=-1, ep_fsdp=None, dense=None):
    par = SimpleNamespace(
        tensor_parallel=tp,
        context_parallel=cp,
        pipeline_parallel=pp,
        expert_parallel=ep,
        data_parallel_shard=shard,
        ep_fsdp_size=ep_fsdp,
        dense_fsdp_shard_size=dense,
    )
    return ParallelDims.from_config(par, world)


def test_expert_parallel_is_carved_from_data_and_context_ranks():
    d = _dims(8, cp=2, ep=4)
    assert (d.dp_shard, d.dp_shard_in_ep, d.dp_shard_mod_ep, d.fsdp_size) == (4, 2, 2, 8)
    assert d.mesh_shape() == (1, 1, 2, 2, 2, 1)
    with pytest.raises(ValueError, match="multiple of context_parallel"):
        _dims(8, cp=4, ep=2)
    with pytest.raises(ValueError, match="must divide data_parallel_shard"):
        _dims(4, ep=3)


def test_ep_fsdp_size_shards_experts_over_part_of_the_ranks_outside_ep():
    # 8 data ranks, ep 2: 4 ranks outside each expert group. Unset (or 4) shards over all 4.
    assert (_dims(8, ep=2).expert_shard, _dims(8, ep=2).expert_replicas) == (4, 1)
    assert _dims(8, ep=2, ep_fsdp=4).ep_fsdp == 0
    # 2 shard each expert, 2 replicas of each shard (HSDP for the experts).
    d = _dims(8, ep=2, ep_fsdp=2)
    assert (d.expert_shard, d.expert_replicas) == (2, 2)
    # MindSpeed's 1: experts replicated over the 4 ranks.
    assert (_dims(8, ep=2, ep_fsdp=1).expert_shard, _dims(8, ep=2, ep_fsdp=1).expert_replicas) == (1, 4)
    # With HSDP the data replicas add to the expert replicas.
    assert _dims(8, ep=2, shard=4, ep_fsdp=1).expert_replicas == 4
    assert _dims(4, ep_fsdp=1).ep_fsdp == 0  # MindSpeed's default without EP: nothing to do
    with pytest.raises(ValueError, match="must divide the 4 data-shard ranks"):
        _dims(8, ep=2, ep_fsdp=3)
    with pytest.raises(ValueError, match="expert_parallel > 1"):
        _dims(8, ep_fsdp=2)


def test_dense_fsdp_shard_size_is_hsdp_for_dense_weights():
    d = _dims(8, cp=2, dense=4)  # 8 ranks shard dense weights by default; groups of 4, 2 replicas
    assert (d.dense_shard_size, d.dense_replicas, d.fsdp_size) == (4, 2, 8)
    assert _dims(8, shard=4, dense=2).dense_replicas == 4  # with HSDP's 2 replicas
    assert _dims(8, dense=8).dense_shard == 0
    with pytest.raises(ValueError, match="must divide the 8 ranks"):
        _dims(8, dense=3)


def test_qwen3_8b_parameter_count_and_memory_plan(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BIG)
    cfg = load_config(path)
    family, counts = count_parameters(cfg)
    # Qwen3-8B: 36 layers of attention (q 4096x4096, k/v 4096x1024, o, q/k norms) and MLP
    # (3 x 4096x12288), two norms each, embedding and untied head 151936x4096, final norm.
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 128 * 2 + 3 * 4096 * 12288 + 2 * 4096
    assert family == "qwen3"
    assert counts.layers == [layer] * 36
    assert counts.total == 36 * layer + 2 * 151936 * 4096 + 4096
    lines = plan_lines(cfg, 1024)
    assert lines[0].startswith("mesh (1024 ranks): pp=4 x dp_replicate=2 x dp_shard_mod_ep=16")
    assert "global batch 1024 = dp 32 x local 1 x accumulation 32" in lines[2]
    assert "2048 tokens per CP rank" in lines[2]
    # Last pipeline rank: 9 layers + head + final norm over tp 4 x FSDP 32.
    per_rank = (9 * layer + 151936 * 4096 + 4096) / (4 * 32)
    assert f"{per_rank / 1e6:.1f}M parameters" in lines[4]


def test_stage_layers_auto_and_explicit():
    assert stage_layers(5, 2, 1, "auto") == [[0, 1, 2], [3, 4]]
    # 4 chunks of 2, 2, 1, 1 layers; chunk s on rank s % 2.
    assert stage_layers(6, 2, 2, "auto") == [[0, 1, 4], [2, 3, 5]]
    assert stage_layers(6, 2, 2, ["0-1,4-5", "2-3"]) == [[0, 1, 4, 5], [2, 3]]


@pytest.mark.procs
def test_cli_prints_the_plan(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BIG)
    validate = [sys.executable, "-m", "meshforge", "config", "validate", str(path), "--world-size", "1024"]
    out = subprocess.run(
        [*validate, "--no-path-checks"],  # corpus.txt is the planned cluster's data, not a file here
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "valid for world size 1024" in out and "memory per rank" in out and "AdamW" in out
