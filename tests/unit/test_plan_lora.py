"""The layout plan of a LoRA run: every rank holds its frozen base and adapters, but gradients and
AdamW state exist for the adapters alone; the activations are traced with the adapters on."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict
from meshforge.config.root import TrainConfig
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.plan import (
    count_parameters,
    measure_plan_activations,
    plan_lines,
    rank_adapters,
    rank_state,
)

RANK = 4
TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "tokenizer_name_or_path": "meshforge://assets/tokenizer",
}
LORA = {"target_modules": TARGETS, "exclude_layers": ["0"], "lora_rank": RANK}
# Megatron's split of a decoder layer: these take column-wise shards, the rest row-wise.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
GIB = 1024**3


def _config(
    *,
    lora: dict[str, Any] | None = LORA,
    model: dict[str, Any] | None = None,
    seq: int = 32,
    **parallelism: object,
) -> TrainConfig:
    data: dict[str, Any] = {
        "model": {**QWEN3, **(model or {})},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": seq}},
        "training": {"local_batch_size": 1, "global_batch_size": 8},
        "parallelism": parallelism,
    }
    if lora is not None:
        data["lora_config"] = lora
    return config_from_dict(data)


def _meta_model(cfg: TrainConfig) -> nn.Module:
    source = resolve_model_source(cfg.model)
    with torch.device("meta"):
        return source.family.build(source.options)


def _adapted(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The targeted linears, chosen here from the pattern (not by the LoRA code)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and re.fullmatch(TARGETS, name) and not name.startswith("model.layers.0.")
    ]


def _layer(name: str) -> int:
    return int(name.split("model.layers.", 1)[1].split(".", 1)[0])


def test_gradients_and_adamw_cover_the_adapters_only() -> None:
    cfg, full = _config(), _config(lora=None)
    model = _meta_model(cfg)
    adapters = sum(RANK * (m.in_features + m.out_features) for _, m in _adapted(model))
    base = sum(p.numel() for p in model.parameters())
    assert adapters == 3 * RANK * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + (96 + 64))
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    _, counts = count_parameters(cfg)
    assert counts.adapters is not None and counts.adapters.total == adapters
    [state] = rank_state(cfg, dims, counts)
    assert state.trainable == adapters and state.parameters == base + adapters
    assert state.gradients == adapters * 4  # fp32 params_dtype
    assert state.optimizer == adapters * 8  # two fp32 moments
    assert state.weights == (base + adapters) * 4  # fp32 compute: the frozen base stays fp32
    _, full_counts = count_parameters(full)
    [whole] = rank_state(full, dims, full_counts)
    assert (whole.weights, whole.gradients, whole.optimizer) == (base * 4, base * 4, base * 8)
    assert whole.total - state.total == base * 16 - (base * 4 + adapters * 16)


def test_the_frozen_base_is_held_in_the_compute_dtype() -> None:
    cfg = _config(model={"compute_dtype": "bfloat16", "params_dtype": "float32"})
    model = _meta_model(cfg)
    adapters = sum(RANK * (m.in_features + m.out_features) for _, m in _adapted(model))
    base = sum(p.numel() for p in model.parameters())
    _, counts = count_parameters(cfg)
    [state] = rank_state(cfg, ParallelDims.from_config(cfg.parallelism, 1), counts)
    assert state.weights == base * 2 + adapters * 4
    assert (state.gradients, state.optimizer) == (adapters * 4, adapters * 8)


def test_adapters_shard_like_their_base_over_tp_and_go_with_their_pipeline_stage() -> None:
    tp = _config(tensor_parallel=2)
    model = _meta_model(tp)
    per_rank = 0.0
    for name, m in _adapted(model):
        a, b = RANK * m.in_features, RANK * m.out_features
        # Column-wise: B split over the 2 TP ranks, A whole on each; row-wise: A split, B whole.
        per_rank += a + b / 2 if name.rsplit(".", 1)[1] in COLWISE else a / 2 + b
    _, counts = count_parameters(tp)
    assert rank_adapters(tp, ParallelDims.from_config(tp.parallelism, 2), counts) == [per_rank]
    # FSDP over 4 ranks shards them further.
    assert rank_adapters(tp, ParallelDims.from_config(tp.parallelism, 8), counts) == [per_rank / 4]

    pp = _config(pipeline_parallel=2, pipeline_parallel_schedule="1f1b")
    layers = {i: 0 for i in range(4)}
    for name, m in _adapted(model):
        layers[_layer(name)] += RANK * (m.in_features + m.out_features)
    _, counts = count_parameters(pp)
    # Stage 0 holds layers 0 (excluded: no adapters) and 1, stage 1 layers 2 and 3.
    assert rank_adapters(pp, ParallelDims.from_config(pp.parallelism, 2), counts) == [
        layers[1],
        layers[2] + layers[3],
    ]


def test_the_trace_runs_the_adapters_on_the_frozen_base() -> None:
    lora, full = _config(), _config(lora=None)
    traced = measure_plan_activations(lora, 1, 32)
    reference = measure_plan_activations(full, 1, 32)
    # Nothing before layer 0 trains and it has no adapters: autograd records nothing there.
    assert traced.layers[0].device == 0 < reference.layers[0].device
    # A frozen linear keeps no input for a weight gradient; an adapted one keeps the adapter's.
    assert 0 < traced.layers[1].device < reference.layers[1].device


def test_validate_prints_the_adapter_state_of_qwen3_8b() -> None:
    shape = {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
    }
    cfg = _config(lora={"target_modules": "all", "lora_rank": 64}, model=shape, seq=4096)
    lines = "\n".join(plan_lines(cfg, 8))
    model = _meta_model(cfg)
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
    adapters = sum(64 * (m.in_features + m.out_features) for m in linears)
    assert f"LoRA r=64 on {36 * 7} linears: {adapters / 1e6:.3f}M adapter parameters" in lines
    per_rank = adapters / 8  # FSDP over the 8 ranks
    expected = f"gradients {per_rank * 4 / GIB:.2f} GiB + AdamW {per_rank * 8 / GIB:.2f} GiB"
    assert expected in lines, lines
    # Full training of the same model: 8.19B parameters x 16 bytes over 8 ranks.
    assert "AdamW 7.63 GiB" in "\n".join(plan_lines(_config(lora=None, model=shape, seq=4096), 8))
