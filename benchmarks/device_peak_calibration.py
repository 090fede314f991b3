"""The predicted per-device peak (`parallel/device_peak.py`) against the dry run's measured one.

    PYTHONPATH=src .venv/bin/python benchmarks/device_peak_calibration.py [--quiet-sharding-prop] [name-fragment ...]

`--quiet-sharding-prop` hides DTensor's sharding propagation from the dry run's memory tracker
(`utils/fake_memory.sharding_propagation_untracked`):
to learn an op's output shape, torch builds fake tensors of the *global* shapes of its DTensor
arguments under the active fake mode, and the tracker counts them as allocations (a fused AdamW
step over FSDP-sharded parameters then "holds" 16 bytes per global parameter: 1 TiB for a 70B
model on any number of ranks). With the flag those calls run outside the dry run's modes, as they
do in a real run (no fake mode active: they make their own). The `large` cases need it.

Each case is a shipped config with layout overrides at a world size; the dry run
(`train/dry_run.py`) runs one whole step of the planner's most loaded rank on fake tensors and
reports its memory high-water mark. The first step is compared (`DevicePeak.first_step`: the
optimizer's moments appear at its update), and the steady-state prediction is printed beside it.
One JSON line per case: measured, predicted, their ratio, the peak's phase, the peak of forward and
backward alone (read when the optimizer step starts) beside its prediction, and the seconds.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from _harness import REPO, emit, utc_now

from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import predict_device_peak
from meshforge.train.dry_run import dry_run
from meshforge.utils.fake_memory import sharding_propagation_untracked

_LLAMA = "configs/llama/tiny.yaml"
_MOE = "configs/qwen3_moe/tiny.yaml"
_DSV3 = "configs/deepseek_v3/tiny.yaml"
_RECOMPUTE = ["--recompute.mode=full", "--recompute.full_recompute_layer=[0-3]"]
_BF16 = ["--model.compute_dtype=bfloat16"]

# name -> (config, world size, overrides)
CASES: dict[str, tuple[str, int, list[str]]] = {
    "llama fsdp8": (_LLAMA, 8, []),
    "llama fsdp8 bf16": (_LLAMA, 8, _BF16),
    "llama tp2 x fsdp4": (_LLAMA, 8, ["--parallelism.tensor_parallel=2"]),
    "llama tp2 loss-parallel": (
        _LLAMA,
        8,
        ["--parallelism.tensor_parallel=2", "--parallelism.enable_loss_parallel=true"],
    ),
    "llama tp2 loss-parallel bf16": (
        _LLAMA,
        8,
        ["--parallelism.tensor_parallel=2", "--parallelism.enable_loss_parallel=true", *_BF16],
    ),
    "llama fsdp8 recompute": (_LLAMA, 8, _RECOMPUTE),
    "llama fsdp8 chunked loss": (_LLAMA, 8, ["--kernels.chunk_loss_size=512"]),
    "llama fsdp8 recompute chunked": (_LLAMA, 8, [*_RECOMPUTE, "--kernels.chunk_loss_size=256"]),
    "llama fsdp8 seq 1024 bf16 recompute chunked": (
        _LLAMA,
        8,
        [
            *_BF16,
            *_RECOMPUTE,
            "--kernels.chunk_loss_size=256",
            "--train_dataset.dataloader.seq_length=1024",
            "--training.local_batch_size=4",
        ],
    ),
    "llama fsdp8 lora": (_LLAMA, 8, ["--lora_config.lora_rank=8", "--lora_config.target_modules=all"]),
    "llama one rank": (_LLAMA, 1, []),
    "llama hsdp 2 x fsdp4": (_LLAMA, 8, ["--parallelism.data_parallel_shard=4"]),
    "llama fsdp8 zero2": (_LLAMA, 8, ["--parallelism.data_parallel_shard_strategy=optim_grads"]),
    "llama tp2 lora recompute chunked": (
        _LLAMA,
        8,
        [
            "--parallelism.tensor_parallel=2",
            "--lora_config.lora_rank=8",
            "--lora_config.target_modules=all",
            *_RECOMPUTE,
            "--kernels.chunk_loss_size=256",
        ],
    ),
    "llama pp2 x fsdp4 1f1b": (
        _LLAMA,
        8,
        ["--parallelism.pipeline_parallel=2", "--training.global_batch_size=256"],
    ),
    "llama cp2 x fsdp4": (_LLAMA, 8, ["--parallelism.context_parallel=2"]),
    "qwen3_moe fsdp4": (_MOE, 4, []),
    "qwen3_moe ep2 x fsdp2": (_MOE, 4, ["--parallelism.expert_parallel=2"]),
    "deepseek_v3 fsdp4": (_DSV3, 4, []),
    "deepseek_v3 ep2 x fsdp2": (_DSV3, 4, ["--parallelism.expert_parallel=2"]),
    # Real-size layouts, one micro-batch per step (a step of 32 takes 16 minutes here).
    "large qwen3_8b fsdp8": (
        "configs/examples/qwen3_8b_pretrain_fsdp8.yaml",
        8,
        [f"--model.model_name_or_path={REPO / 'tests/data/qwen3_8b'}", "--training.global_batch_size=16"],
    ),
    "large llama3_1_70b tp8 x fsdp8": (
        "configs/examples/llama3_1_70b_tp8_fsdp.yaml",
        64,
        [f"--model.model_name_or_path={REPO / 'tests/data/llama3_1_70b'}", "--training.global_batch_size=16"],
    ),
}


class _BeforeUpdate:
    """The dry run's tracked peak when the optimizer step starts (forward and backward only).

    Wraps `dry_run._new_step_peak` (the tracker the step uses) and `torch.optim.AdamW.step`.
    """

    def __init__(self) -> None:
        import torch

        import meshforge.train.dry_run as module

        self.peak: float | None = None
        self._tracker: Any = None
        make, step = module._new_step_peak, torch.optim.AdamW.step

        def new_tracker() -> Any:
            self._tracker = make()
            self.peak = None
            return self._tracker

        def wrapped(optimizer: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
            if self.peak is None and self._tracker is not None:
                self.peak = float(max(self._tracker._peak_mem.values(), default=0))
            return step(optimizer, *args, **kwargs)

        module._new_step_peak = new_tracker
        torch.optim.AdamW.step = wrapped  # type: ignore[method-assign,assignment]


_BEFORE = _BeforeUpdate()


def run_case(name: str, config: str, world: int, overrides: list[str]) -> dict[str, object]:
    cfg = load_config(str(REPO / config), overrides, log=lambda _: None)
    started = time.perf_counter()
    predicted = predict_device_peak(cfg, world)
    predict_s = time.perf_counter() - started
    record: dict[str, object] = {"case": name, "world_size": world, "rank": predicted.rank}
    try:
        report = dry_run(cfg, world_size=world, rank=predicted.rank, log=lambda _: None)
    except Exception as exc:  # noqa: BLE001 - a layout the dry run cannot run yet is reported, not fatal
        record["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return record
    mib = 1024**2
    record.update(
        measured_mib=round(report.peak_bytes / mib, 1),
        predicted_first_step_mib=round(predicted.first_step / mib, 1),
        predicted_steady_mib=round(predicted.allocated / mib, 1),
        ratio=round(report.peak_bytes / predicted.first_step, 3),
        phase=predicted.phase,
        # Forward and backward alone (the moments are not there yet in the first step).
        measured_before_update_mib=round((_BEFORE.peak or 0) / mib, 1),
        predicted_before_update_mib=(
            round((predicted.allocated - predicted.optimizer) / mib, 1)
            if predicted.phase != "optimizer"
            else None
        ),
        components_mib={k: round(v / mib, 1) for k, v in predicted.components().items()},
        dry_run_s=round(report.seconds, 1),
        predict_s=round(predict_s, 1),
        when=utc_now(),
    )
    return record


def main(only: list[str]) -> None:
    quiet = "--quiet-sharding-prop" in only
    only = [part for part in only if part != "--quiet-sharding-prop"]
    with sharding_propagation_untracked() if quiet else contextlib.nullcontext():
        for name, (config, world, overrides) in CASES.items():
            if only and not any(part in name for part in only):
                continue
            emit(run_case(name, config, world, overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
