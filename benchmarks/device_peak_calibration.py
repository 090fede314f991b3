"""The predicted per-device peak (`parallel/device_peak.py`) against the dry run's measured one.

    PYTHONPATH=src .venv/bin/python benchmarks/device_peak_calibration.py [name-fragment ...]

Each case is a shipped config with layout overrides at a world size; the dry run
(`train/dry_run.py`) runs one whole steady-state step (the optimizer's moments primed) of the
planner's most loaded rank on fake tensors and reports its memory high-water mark, compared with
`DevicePeak.allocated`. One JSON line per case: measured, predicted, their ratio, the predicted
peak's phase and components, and the seconds.
"""

from __future__ import annotations

import sys
import time

from _harness import REPO, emit, utc_now

from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import predict_device_peak
from meshforge.train.dry_run import dry_run

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
    # Real-size layouts, two micro-batches per step (the dry run runs two of any larger number).
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
        predicted_mib=round(predicted.allocated / mib, 1),
        ratio=round(report.peak_bytes / predicted.allocated, 3),
        phase=predicted.phase,
        components_mib={k: round(v / mib, 1) for k, v in predicted.components().items()},
        dry_run_s=round(report.seconds, 1),
        predict_s=round(predict_s, 1),
        when=utc_now(),
    )
    return record


def main(only: list[str]) -> None:
    for name, (config, world, overrides) in CASES.items():
        if only and not any(part in name for part in only):
            continue
        emit(run_case(name, config, world, overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
