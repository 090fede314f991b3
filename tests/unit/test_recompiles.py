"""Compiled decoder layers do not recompile across steps of packed rows (``kernels.compile: true``).

A real run through the ``Trainer``: LLaMA-Factory-style SFT with neat packing, so every row holds
several documents of varying lengths (``segment_ids`` and restarting ``position_ids`` change from
step to step) and the last batch may be short (``drop_remainder: false``). Twenty steps must reuse
the graphs of the first: dynamo's counters give the graphs compiled and the frames converted.

The packing loaders pad every row to ``cutoff_len``, so the shapes a layer sees are the same at
every step and nothing needs marking dynamic; what changes is data (the mask, the positions, the
expert counts of the MoE layers), which the layers keep out of their guards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch._dynamo as dynamo

from tests.conftest import REPO, read_metrics, train_here

SMALL = [
    "--training.steps=20",
    "--training.log_interval=100",
    "--training.local_batch_size=2",
    "--training.global_batch_size=2",
    "--checkpoint.save_interleaved_steps=1000",
    "--kernels.compile=true",
    "--train_dataset.cutoff_len=64",
    "--train_dataset.neat_packing=true",
    "--train_dataset.drop_remainder=false",
    "--model.hidden_size=32",
    "--model.intermediate_size=64",
    "--model.num_hidden_layers=2",
    "--model.num_attention_heads=2",
    "--model.num_key_value_heads=1",
    "--model.head_dim=16",
]
MOE = [
    "--model.model_type=qwen3_moe",
    "--model.architectures=Qwen3MoeForCausalLM",
    "--model.num_experts=4",
    "--model.num_experts_per_tok=2",
    "--model.moe_intermediate_size=16",
]


@pytest.mark.procs  # inductor compiles its C++ kernels in processes
def test_packed_steps_reuse_the_compiled_layers(tmp_path: Path):
    # qwen3_moe: its layers hold everything a dense layer has, plus the data-dependent expert loop.
    out = tmp_path / "run"
    overrides = [*SMALL, *MOE, f"--training.output_dir={out}"]
    dynamo.reset()
    dynamo.utils.counters.clear()
    # The MoE expert loop reads its group sizes on the host (see tests/unit/test_graph_breaks.py).
    with dynamo.config.patch(capture_scalar_outputs=True):
        train_here(REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml", overrides)
    counters = dynamo.utils.counters
    assert len(read_metrics(out)) == 20
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One layer kind per model: one frame (the layer call), one graph, captured at every call.
    assert counters["frames"]["ok"] == counters["frames"]["total"] <= 2, dict(counters["frames"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert counters["stats"]["calls_captured"] > 0
    dynamo.reset()
