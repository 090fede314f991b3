"""The planner's activation memory against what a real forward saves, and its scaling to a layout.

The prediction (a trace on fake tensors, scaled to the rank) must be within 20% of the bytes the
saved-tensor ledger counts in a real one-process forward and loss with the same settings, for no
recompute, full and select recompute, and swap (device and host bytes).
"""

from __future__ import annotations

import pytest
import torch

from meshforge.config import config_from_dict
from meshforge.config.root import TrainConfig
from meshforge.loss.cross_entropy import chunked_cross_entropy_sum, cross_entropy_sum
from meshforge.memory.apply import ActivationSettings, apply_activation_memory
from meshforge.memory.ledger import SavedTensorLedger
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.plan import (
    activation_lines,
    activation_plan,
    count_parameters,
    in_flight,
    measure_plan_activations,
)

SEQ, MICRO = 128, 2
TOLERANCE = 0.20

MODES = {
    "none": {},
    "full": {"recompute": {"mode": "full", "full_recompute_layer": ["0-3"]}},
    "select_attention": {"recompute": {"mode": "select", "select_module": {"attention": ["0-3"]}}},
    "select_mlp": {"recompute": {"mode": "select", "select_module": {"mlp": ["0-3"]}}},
    "swap": {"swap": {"enable": True, "layer_swap": [{"layers": ["0-2"]}]}},
    "op_swap": {"swap": {"enable": True, "op_swap": [{"op_name": "attention", "layers": ["0-2"]}]}},
}

QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _config(model: dict, extra: dict, *, chunk: int | None = None, **sections: dict) -> TrainConfig:
    data = {
        "model": model,
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": SEQ}},
        "training": {"local_batch_size": MICRO, "global_batch_size": 4 * MICRO},
        **extra,
        **sections,
    }
    if chunk:
        data["kernels"] = {"chunk_loss_size": chunk}
    return config_from_dict(data)


def _real(cfg: TrainConfig) -> SavedTensorLedger:
    """The ledger of one real forward and loss in one process (random weights)."""
    from meshforge.checkpoint.source import resolve_model_source

    source = resolve_model_source(cfg.model)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    settings = ActivationSettings(cfg.recompute, cfg.recompute_comm, cfg.swap)
    if settings.active:
        apply_activation_memory(model, settings, num_layers=len(model.model.layers), tp_mesh=None)
    ids = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        chunk = cfg.kernels.chunk_loss_size
        if chunk:
            hidden = model(ids, return_hidden=True)
            chunked_cross_entropy_sum(hidden, model.lm_head.weight, ids, chunk_size=chunk)
        else:
            cross_entropy_sum(model(ids), ids)
    return ledger


def _predicted(cfg: TrainConfig, world: int = 1):
    dims = ParallelDims.from_config(cfg.parallelism, world)
    _, counts = count_parameters(cfg)
    estimate = measure_plan_activations(cfg, MICRO, SEQ // dims.cp)
    return activation_plan(cfg, dims, counts, estimate), estimate


def _within(predicted: float, measured: float) -> None:
    assert measured > 0
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("chunk", [None, 64], ids=["full_logits", "chunked_loss"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_prediction_is_within_20_percent_of_a_real_forward(mode: str, chunk: int | None) -> None:
    cfg = _config(QWEN3, MODES[mode], chunk=chunk)
    measured = _real(cfg)
    (rank,), _ = _predicted(cfg)
    _within(rank.device_bytes, measured.device_bytes)
    if measured.host_bytes:
        _within(rank.host_bytes, measured.host_bytes)
    else:
        assert rank.host_bytes == 0


def test_swap_moves_the_prediction_to_host() -> None:
    (none,), _ = _predicted(_config(QWEN3, {}))
    (swap,), estimate = _predicted(_config(QWEN3, MODES["swap"]))
    # Three of four layers go to host: what leaves the device arrives there.
    assert swap.device_bytes < 0.5 * none.device_bytes
    assert swap.device_bytes + swap.host_bytes == pytest.approx(none.device_bytes, rel=0.02)
    assert [estimate.layers[i].host > 0 for i in range(4)] == [True, True, True, False]


def test_moe_layers_traced_with_balanced_routing_within_20_percent() -> None:
    """Fake tensors hold no routing counts: the experts' split is taken as balanced
    (`models/common/moe.host_ints`), so MoE layers are traced like dense ones, not by formula."""
    for extra in ({}, MODES["swap"]):
        cfg = _config(QWEN3_MOE, extra)
        measured = _real(cfg)
        (rank,), estimate = _predicted(cfg)
        assert not any("by formula" in note for note in estimate.notes)
        _within(rank.device_bytes, measured.device_bytes)
        if measured.host_bytes:
            _within(rank.host_bytes, measured.host_bytes)


def test_in_flight_micro_batches_per_schedule() -> None:
    assert in_flight("1f1b", pp=1, rank=0, micro_batches=8, interleave=1) == 1
    assert in_flight("gpipe", pp=4, rank=3, micro_batches=8, interleave=1) == 8
    assert [in_flight("1f1b", pp=4, rank=r, micro_batches=8, interleave=1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", pp=4, rank=0, micro_batches=2, interleave=1) == 2
    # Interleaved, 2 chunks per rank on 2 ranks: rank 0 warms up (2-1)*2 + 2*1 = 4 chunk forwards, +1.
    assert in_flight("interleaved", pp=2, rank=0, micro_batches=8, interleave=2) == 2.5
    assert in_flight("zbv", pp=2, rank=1, micro_batches=8, interleave=2) == 1.5


def test_layout_scaling_tp_pp_and_cp() -> None:
    (one,), estimate = _predicted(_config(QWEN3, {}))
    per_layer = [estimate.layers[i].device for i in range(4)]
    # pp2 1f1b with 4 micro-batches per step: rank 0 holds 2 micro-batches of layers 0-1,
    # rank 1 one of layers 2-3 plus the head and loss.
    cfg = _config(QWEN3, {"parallelism": {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}})
    rows, _ = _predicted(cfg, world=2)
    assert rows[0].device_bytes == 2 * sum(per_layer[:2])
    assert rows[1].device_bytes == sum(per_layer[2:]) + estimate.outside
    # tp2 halves the layers' share (sequence parallel); the replicated logits stay whole.
    rows, _ = _predicted(_config(QWEN3, {"parallelism": {"tensor_parallel": 2}}), world=2)
    assert rows[0].device_bytes == sum(per_layer) / 2 + estimate.outside
    assert one.device_bytes == sum(per_layer) + estimate.outside
    # cp2 traces half the tokens per rank.
    rows, _ = _predicted(_config(QWEN3, {"parallelism": {"context_parallel": 2}}), world=2)
    assert 0.4 * one.device_bytes < rows[0].device_bytes < 0.6 * one.device_bytes


def test_plan_lines_give_the_peak_and_the_device_memory_verdict() -> None:
    from meshforge.parallel.device_peak import peak_lines

    cfg = _config(QWEN3, {}, context={"max_device_memory": "2GB"})
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    _, counts = count_parameters(cfg)
    lines = activation_lines(cfg, dims, counts)
    assert lines[0].startswith(f"activations per rank (micro-batch {MICRO} x {SEQ} tokens, recompute None")
    peak = peak_lines(cfg, 1)
    assert peak[0].startswith("predicted peak per rank (every rank): state")
    assert peak[0].endswith("; fits context.max_device_memory 2GB")
    cfg = _config(QWEN3, {}, context={"max_device_memory": "0.001GB"})
    assert peak_lines(cfg, 1)[0].endswith("; does NOT fit context.max_device_memory 0.001GB")
    # Without max_device_memory set there is no verdict (its default is an Ascend setting).
    assert "max_device_memory" not in peak_lines(_config(QWEN3, {}), 1)[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next", "generic"])
def test_every_family_traces_within_20_percent(family: str) -> None:
    """MoE (formula), MLA, Gated DeltaNet and the generic transformers path."""
    from meshforge.memory.estimate import measure_activations
    from tests.unit.test_swap import FAMILIES

    torch.manual_seed(0)
    model = FAMILIES[family]()
    ids = torch.randint(0, 64, (MICRO, 32), generator=torch.Generator().manual_seed(1))
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        out = model(input_ids=ids)
        cross_entropy_sum(out if isinstance(out, torch.Tensor) else out.logits, ids)
    estimate = measure_activations(
        FAMILIES[family],
        ActivationSettings(),
        micro_batch=MICRO,
        seq=32,
        dtype=torch.float32,
        chunk_loss_size=None,
    )
    _within(estimate.device_bytes, ledger.device_bytes)
