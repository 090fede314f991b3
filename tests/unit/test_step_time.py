"""The step-time model: FLOPs counted independently from the built model, collectives priced by
hand, pipeline bubbles, the CLI line, and the fitted factors against the published runs."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from meshforge.checkpoint.source import resolve_model_source
from meshforge.cli.config import main as config_main
from meshforge.config import config_from_dict
from meshforge.config.loader import load_config
from meshforge.config.root import TrainConfig
from meshforge.parallel.step_time import Efficiency, _transfer_seconds, predict_step
from meshforge.parallel.workload import model_work
from meshforge.utils.hardware import HARDWARE, hardware

ROOT = Path(__file__).resolve().parents[2]
SEQ = 64
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "tokenizer_name_or_path": "meshforge://assets/tokenizer",
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
# Every factor 1 and no memory-bound work: compute is FLOPs / peak, to check the counting.
IDEAL = Efficiency(
    matmul=1.0,
    matmul_width=0.0,
    experts=1.0,
    expert_tokens=0.0,
    attention=1.0,
    elementwise_eager=0.0,
    elementwise_compiled=0.0,
    optimizer_bytes=0.0,
)


def _config(model: dict[str, Any] = QWEN3, **sections: dict[str, Any]) -> TrainConfig:
    data: dict[str, Any] = {
        "model": {**model, "params_dtype": "float32", "compute_dtype": "bfloat16"},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": SEQ}},
        "training": {"local_batch_size": 2, "global_batch_size": 8},
    }
    for name, value in sections.items():
        data[name] = {**data.get(name, {}), **value}
    return config_from_dict(data)


def _hand_flops(cfg: TrainConfig, *, passes: float = 3.0) -> float:
    """Training FLOPs of one token, counted from the built model's linear layers in float64."""
    source = resolve_model_source(cfg.model)
    with torch.device("meta"):
        model = source.family.build(source.options)
    linears = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    args = QWEN3
    heads, dim, layers = args["num_attention_heads"], args["head_dim"], args["num_hidden_layers"]
    context = SEQ - SEQ / 2.0  # mean keys under a causal mask
    attention = layers * 2.0 * heads * (dim + dim) * context * 3.0
    return passes * 2.0 * linears + attention


def test_dense_compute_is_flops_over_peak() -> None:
    cfg = _config()
    hw = hardware("h100")
    p = predict_step(cfg, 1, hw, eff=IDEAL)
    tokens = 8 * SEQ  # accumulation 4 x local 2
    expected = tokens * _hand_flops(cfg) / hw.bf16_flops
    assert math.isclose(p.compute, expected, rel_tol=1e-9)
    assert p.exposed_comm == 0 and p.bubble == 0 and not p.collectives


def test_kept_operators_are_not_priced_again_in_the_recomputation() -> None:
    """`exclude_op: [mm/2, sdpa]` (torchtitan's op policy): the 1st, 3rd, 5th and 7th projection
    of each layer (q, v, gate, down) and the attention core keep their outputs."""
    full = {"mode": "full", "full_recompute_layer": ["0-3"]}
    work = model_work(_config(recompute={**full, "exclude_op": ["mm/2", "sdpa"]}))
    h, kv, inter = QWEN3["hidden_size"], QWEN3["num_key_value_heads"] * 16, QWEN3["intermediate_size"]
    q, k, v, o = h * 4 * 16, h * kv, h * kv, 4 * 16 * h
    gate, up, down = h * inter, h * inter, inter * h
    recomputed = (k + o + up) / (q + k + v + o + gate + up + down)
    for layer in work.layers:
        assert math.isclose(layer.recompute, recomputed, rel_tol=1e-9)
        assert not layer.recompute_attention
    every = model_work(_config(recompute={**full, "exclude_op": ["matmul"]}))
    assert all(layer.recompute == 0 and layer.recompute_attention for layer in every.layers)


def test_full_recompute_adds_one_forward_of_the_layers() -> None:
    hw = hardware("h100")
    base = predict_step(_config(), 1, hw, eff=IDEAL)
    recomputed = predict_step(
        _config(recompute={"mode": "full", "full_recompute_layer": ["0-3"]}), 1, hw, eff=IDEAL
    )
    work = model_work(_config())
    layer_forward = sum(
        layer.matmul_forward_flops() + sum(c.forward_flops(SEQ / 2.0) for c in layer.attention)
        for layer in work.layers
    )
    assert math.isclose(
        recomputed.compute - base.compute, 8 * SEQ * layer_forward / hw.bf16_flops, rel_tol=1e-9
    )


def test_lora_drops_the_weight_gradients_of_the_frozen_base() -> None:
    hw = hardware("h100")
    ideal = Efficiency(**{**IDEAL.__dict__, "adapter_bytes": 0.0})
    lora = _config(lora_config={"target_modules": "all", "lora_rank": 4})
    p = predict_step(lora, 1, hw, eff=ideal)
    cfg = _config()
    # Weight matmuls twice (forward, input gradient), attention products three times.
    attention = _hand_flops(cfg) - 3.0 * 2.0 * _linear_count(cfg)
    expected = 8 * SEQ * (2.0 * 2.0 * _linear_count(cfg) + attention) / hw.bf16_flops
    assert math.isclose(p.compute, expected, rel_tol=1e-3)  # the adapters' own matmuls are not counted
    assert p.optimizer < predict_step(cfg, 1, hw).optimizer


def _linear_count(cfg: TrainConfig) -> int:
    source = resolve_model_source(cfg.model)
    with torch.device("meta"):
        model = source.family.build(source.options)
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))


def test_moe_layers_count_the_active_experts_only() -> None:
    work = model_work(_config(QWEN3_MOE))
    layer = work.layers[0]
    assert layer.top_k == 2 and math.isclose(layer.active, 2 / 8)
    # gate_up (2 x 32 x 64) and down (64 x 32) per expert, 8 experts.
    assert layer.experts == 8 * (2 * 32 * 64 + 64 * 32)
    expected = 2.0 * (layer.dense + layer.experts * 2 / 8)
    assert math.isclose(layer.matmul_forward_flops(), expected)


def test_ring_and_all_to_all_prices() -> None:
    hw = hardware("h100")
    eff = Efficiency(link=0.5)
    size = 1e9
    # Inside a node: every rank sends (n - 1) / n of the tensor over NVLink.
    assert math.isclose(_transfer_seconds("ring", size, 8, 1, hw, eff), size * 7 / 8 / (450e9 * 0.5))
    # 32 ranks over 4 nodes: a node takes in 3/4 of the tensor through its 8 NICs; NVLink is faster.
    across = size * 3 / 4 / (8 * 50e9 * 0.5)
    inside = size * 31 / 32 / (450e9 * 0.5)
    assert math.isclose(_transfer_seconds("ring", size, 32, 1, hw, eff), max(across, inside))
    # An all-to-all over 16 ranks on 2 nodes: 8 of its 15 peers are on the other node, one NIC each.
    sent = size * 15 / 16
    expected = max(sent * 7 / 15 / (450e9 * 0.5), sent * 8 / 15 / (50e9 * 0.5))
    assert math.isclose(_transfer_seconds("all-to-all", size, 16, 1, hw, eff), expected)


def test_layout_collectives_and_bubbles() -> None:
    hw = hardware("h100")
    moe = _config(
        QWEN3_MOE,
        parallelism={"expert_parallel": 16, "data_parallel_shard": 16},
        training={"global_batch_size": 32},
    )
    p = predict_step(moe, 16, hw, eff=IDEAL)
    kinds = {(c.dim, c.kind): c for c in p.collectives}
    assert kinds[("ep", "all-to-all")].crosses_nodes and not kinds[("ep", "all-to-all")].hidden
    assert kinds[("fsdp", "all-gather")].hidden
    pp = {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}
    one_f_one_b = predict_step(_config(parallelism=pp), 2, hw, eff=IDEAL)
    interleaved = predict_step(
        _config(
            parallelism={
                **pp,
                "pipeline_parallel_schedule": "interleaved1f1b",
                "pipeline_parallel_interleave_num": 2,
            }
        ),
        2,
        hw,
        eff=IDEAL,
    )
    per_micro = one_f_one_b.compute / 4  # accumulation 4 on 1 data rank
    assert math.isclose(one_f_one_b.bubble, per_micro, rel_tol=1e-9)  # pp - 1 = 1 slot
    assert math.isclose(interleaved.bubble, interleaved.compute / 4 / 2, rel_tol=1e-9)


def test_validate_prints_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        config_main(["validate", str(ROOT / "configs/demo.yaml"), "--device", "h100", "--world-size", "2"])
        == 0
    )
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "predicted throughput" in line)
    assert "tokens/s per device (MFU" in line and "step" in line and "bound by" in line
    assert config_main(["validate", str(ROOT / "configs/demo.yaml"), "--device", "cpu"]) == 0
    cpu = capsys.readouterr().out
    assert "valid for world size 1" in cpu and "MFU" not in cpu  # the CPU figure is a measured throughput


def test_unknown_device_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_main(["validate", str(ROOT / "configs/demo.yaml"), "--device", "x100"]) == 2
    assert "x100" in capsys.readouterr().err
    with pytest.raises(ValueError, match="valid: h100"):
        hardware("x100")
    assert all(row.source for row in HARDWARE.values())


def test_fitted_factors_hold_on_every_calibration_run(tmp_path: Path) -> None:
    """Each published calibration run within 0.75-1.33x (benchmarks/step_time_calibration.py
    prints the same figures)."""
    runs = yaml.safe_load((ROOT / "benchmarks/published_runs.yaml").read_text(encoding="utf-8"))
    for run in runs["calibration"]:
        folder = tmp_path / Path(run["model_config"]).stem
        folder.mkdir(exist_ok=True)
        shutil.copy(ROOT / run["model_config"], folder / "config.json")
        cfg = load_config(
            str(ROOT / run["config"]), [*run["overrides"], f"--model.model_name_or_path={folder}"]
        )
        assert cfg.train_dataset.seq_length() == run["seq"], run["name"]
        p = predict_step(cfg, run["world_size"], hardware(run["device"]))
        ratio = p.tokens_per_device / run["tokens_per_s"]
        assert 0.75 <= ratio <= 1.33, (run["name"], ratio)
