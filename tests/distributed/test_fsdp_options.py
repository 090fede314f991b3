"""FSDP2 options from the parallelism section: CPU offload, prefetch depths, units by pattern."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow


def test_cpu_offload_and_prefetch_depths_equal_one_process(tiny_config: Path, tmp_path: Path) -> None:
    common = ["--training.steps=3", "--checkpoint.enable_save=false"]
    one = tmp_path / "one"
    run_train(tiny_config, [*common, f"--training.output_dir={one}"], cwd=tmp_path)
    ref = read_metrics(one)
    variants = {
        "offload": ["--parallelism.cpu_offload=true"],
        "prefetch": [
            "--parallelism.num_to_forward_prefetch=2",
            "--parallelism.num_to_backward_prefetch=0",
            "--parallelism.hook_modules=['model.layers.{0-1}']",
        ],
        # Units by pattern on a built-in family: attention and MLP of each layer separately.
        "units": [
            "--parallelism.fsdp_modules=['model.layers.{*}.self_attn', 'model.layers.{*}.mlp']",
            "--parallelism.num_to_forward_prefetch=2",
        ],
        # Mean of per-rank token means: packed text rows have the same valid-token count on
        # every rank, so it equals the global token mean here (test_loss_normalizer covers the rest).
        "rank_mean": ["--parallelism.disable_gradient_division=false"],
        "zero2": ["--parallelism.data_parallel_shard_strategy=optim_grads"],
        # Each decoder layer (an FSDP unit) runs its 2 rows one at a time.
        "chunk_batch": ["--parallelism.enable_chunk_batch=true", "--parallelism.chunk_mbs=2"],
    }
    for name, extra in variants.items():
        out = tmp_path / name
        proc = run_train(
            tiny_config, [*common, *extra, f"--training.output_dir={out}"], nproc=2, cwd=tmp_path
        )
        if name == "offload":
            # A CPU run keeps its parameters in host memory anyway, and says so.
            assert "parallelism.cpu_offload: no effect on cpu" in proc.stdout + proc.stderr
        for x, y in zip(ref, read_metrics(out), strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), name
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), name


def test_bf16_gradient_reduction_stays_close(tiny_config: Path, tmp_path: Path) -> None:
    # parallelism.reduce_dtype: bf16 sums the gradients in bfloat16 (half the bytes): close to
    # the fp32 run, not equal.
    common = ["--training.steps=3", "--checkpoint.enable_save=false"]
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    run_train(tiny_config, [*common, f"--training.output_dir={fp32}"], nproc=2, cwd=tmp_path)
    run_train(
        tiny_config,
        [*common, "--parallelism.reduce_dtype=bf16", f"--training.output_dir={bf16}"],
        nproc=2,
        cwd=tmp_path,
    )
    for x, y in zip(read_metrics(fp32), read_metrics(bf16), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-2)


def test_ignored_modules_train_and_resume_a_checkpoint_saved_without_them(
    tiny_config: Path, tmp_path: Path
) -> None:
    """`parallelism.ignored_modules` through `meshforge train`: the dp2 run (embedding and head left
    unsharded, their gradients summed by the trainer) continues a one-process checkpoint, whose
    optimizer has no group for the unsharded parameters, with the one-process losses."""
    one, ignored = tmp_path / "one", tmp_path / "ignored"
    run_train(tiny_config, ["--training.steps=4", f"--training.output_dir={one}"], cwd=tmp_path)
    step2 = one / "checkpoints" / "checkpoint-00000002"
    run_train(
        tiny_config,
        [
            "--training.steps=4",
            "--checkpoint.enable_save=false",
            "--parallelism.ignored_modules=['model.embed_tokens']",
            f"--checkpoint.load_path={step2}",
            f"--training.output_dir={ignored}",
        ],
        nproc=2,
        cwd=tmp_path,
    )
    want, got = read_metrics(one)[2:], read_metrics(ignored)
    assert [r["step"] for r in got] == [3, 4]
    for x, y in zip(want, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
