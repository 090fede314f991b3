"""`predict_device_peak`: one rank's peak by component, on the tiny Llama config (~5M parameters).

The components add up, pipeline stages hold their schedule's micro-batches, recompute and the
chunked loss lower the peak, and one tiny layout agrees with the dry run's measured peak.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import DevicePeak, predict_device_peak

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "configs" / "llama" / "tiny.yaml")
RECOMPUTE = ("--recompute.mode=full", "--recompute.full_recompute_layer=[0-3]")
PP2 = ("--parallelism.pipeline_parallel=2", "--training.global_batch_size=256")  # 4 data ranks x 16 x 4


@functools.cache
def _peak(world: int, *overrides: str, rank: int | None = None) -> DevicePeak:
    cfg = load_config(LLAMA, list(overrides), log=lambda _: None)
    return predict_device_peak(cfg, world, rank)


def test_components_add_up_to_the_allocated_peak() -> None:
    for overrides in ((), RECOMPUTE, PP2):
        peak = _peak(8, *overrides)
        assert peak.allocated == pytest.approx(sum(peak.components().values()), rel=1e-12)
        assert peak.device_total == pytest.approx(peak.reserved + peak.overhead, rel=1e-12)
        assert peak.reserved > peak.allocated
        assert 0 < peak.overhead < peak.device_total
        assert peak.first_step <= peak.allocated
        # Steady state: the AdamW moments are two copies of the fp32 gradients' size.
        assert peak.optimizer == pytest.approx(2 * 4 * peak.params / 4, rel=1e-9)


def test_reserved_adds_fragmentation_and_fsdps_collective_stream_pools() -> None:
    from meshforge.parallel.device_peak import FRAGMENTATION

    alone = _peak(1)
    assert alone.collective_pools == 0 and alone.reserved == pytest.approx(alone.allocated * FRAGMENTATION)
    sharded = _peak(8)
    # The reduce-scatter stream keeps the sharded gradients (freed at zero_grad, pages kept) and the
    # all-gather stream the root's gathered weights: both outside the compute stream's peak.
    grads = sharded.params  # fp32 gradients of the fp32 shard
    assert sharded.grads == 0 and sharded.collective_pools > grads
    assert sharded.reserved == pytest.approx(sharded.allocated * FRAGMENTATION + sharded.collective_pools)


def test_full_logits_loss_peaks_at_the_loss_with_its_float32_gradients() -> None:
    peak = _peak(8)
    tokens, vocab = 16 * 128, 8192
    assert peak.phase == "loss"
    assert peak.loss == 2 * tokens * vocab * 4


def test_pipeline_stages_hold_their_schedules_micro_batches() -> None:
    first = _peak(8, *PP2, rank=0)
    last = _peak(8, *PP2, rank=4)
    assert (first.stage, last.stage) == (0, 1)
    assert (first.in_flight, last.in_flight) == (2, 1)  # 1F1B: pp - stage
    gpipe = _peak(8, *PP2, "--parallelism.pipeline_parallel_schedule=gpipe", rank=0)
    assert gpipe.in_flight == 4  # every micro-batch of the step
    assert gpipe.activations > first.activations
    # A stage never reshards: its layers stay unsharded and their gradients accumulate unsharded.
    assert first.unsharded_params > _peak(8, rank=0).unsharded_params / 2
    assert first.pipeline > 0


def test_recompute_lowers_the_peak_and_rebuilds_one_layer() -> None:
    plain = _peak(8, "--kernels.chunk_loss_size=256")
    recomputed = _peak(8, "--kernels.chunk_loss_size=256", *RECOMPUTE)
    assert recomputed.allocated < 0.6 * plain.allocated
    assert recomputed.phase == "backward" and recomputed.rebuilt > 0
    assert plain.rebuilt == 0


def test_chunked_loss_lowers_the_peak() -> None:
    full = _peak(8)
    chunked = _peak(8, "--kernels.chunk_loss_size=256")
    assert chunked.loss < full.loss / 4
    assert chunked.allocated < full.allocated


@pytest.mark.slow  # one dry-run step of the tiny model: 2-5 s here
def test_prediction_matches_the_dry_runs_measured_peak() -> None:
    from meshforge.train.dry_run import dry_run

    cfg = load_config(LLAMA, ["--parallelism.tensor_parallel=2"], log=lambda _: None)
    report = dry_run(cfg, world_size=8, log=lambda _: None)
    predicted = predict_device_peak(cfg, 8, report.rank)
    assert report.predicted_peak_bytes == predicted.allocated  # a steady-state step: moments primed
    assert 0.8 <= report.peak_bytes / predicted.allocated <= 1.25, (report.peak_bytes, predicted.describe())


def test_expert_parallel_adds_the_dispatch_buffers_of_one_moe_layer() -> None:
    moe = str(ROOT / "configs" / "qwen3_moe" / "tiny.yaml")
    chunked = ["--kernels.chunk_loss_size=64"]  # the loss's chunk stays small: a layer's backward peaks
    plain = predict_device_peak(load_config(moe, chunked, log=lambda _: None), 4)
    ep = predict_device_peak(
        load_config(moe, [*chunked, "--parallelism.expert_parallel=2"], log=lambda _: None), 4
    )
    assert plain.phase == ep.phase == "backward"
    assert plain.dispatch == 0
    # tokens of a micro-batch (2 x 128) x top-k 2 x hidden 256 x fp32, sent and received
    assert ep.dispatch == 2 * (2 * 128) * 2 * 256 * 4
    # Each EP rank gathers half the experts of a layer instead of all of them.
    assert ep.unsharded_params < plain.unsharded_params


def test_cpu_offload_moves_the_sharded_state_to_the_host() -> None:
    on_device = _peak(8)
    offloaded = _peak(8, "--parallelism.cpu_offload=true")
    assert offloaded.params == offloaded.optimizer == 0 and on_device.params > 0
    assert offloaded.host == pytest.approx(on_device.params * 4, rel=1e-9)  # weights, grads, 2 moments
    assert offloaded.allocated == pytest.approx(on_device.allocated - on_device.params * 3, rel=1e-9)
