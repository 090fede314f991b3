"""FSDP2 options from the parallelism section: CPU offload, prefetch depths, units by pattern.

Two kinds of check. `meshforge train` on 2 ranks with each option logs the one-process losses
(the option changes nothing it should not). And, since equal numbers cannot tell an option from
its absence, 2 spawned ranks build the real `Trainer` from the same config with each option and
look at what it did: the dtype each gradient reduce-scatter ran in, whether the units reshard
after forward (and so all-gather again in backward), the units' explicit prefetch lists, the
offload policy, and the divisor of each rank's loss.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import TINY_CONFIG, read_metrics, write_corpus
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def test_cpu_offload_and_prefetch_depths_equal_one_process(tiny_config: Path, tmp_path: Path) -> None:
    common = ["--training.steps=3", "--checkpoint.enable_save=false"]
    one = tmp_path / "one"
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
    # One process here, every variant in one spawn of 2 ranks.
    runs = [Run(tiny_config, [*common, f"--training.output_dir={one}"])]
    for name, extra in variants.items():
        overrides = [*common, *extra, f"--training.output_dir={tmp_path / name}"]
        runs.append(Run(tiny_config, overrides, 2, log=tmp_path / f"{name}.log"))
    train_all(runs)
    # A CPU run keeps its parameters in host memory anyway, and says so.
    assert "parallelism.cpu_offload: no effect on cpu" in (tmp_path / "offload.log").read_text()
    ref = read_metrics(one)
    for name in variants:
        for x, y in zip(ref, read_metrics(tmp_path / name), strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), name
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), name


def test_bf16_gradient_reduction_stays_close(tiny_config: Path, tmp_path: Path) -> None:
    # parallelism.reduce_dtype: bf16 sums the gradients in bfloat16 (half the bytes): close to
    # the fp32 run, not equal.
    common = ["--training.steps=3", "--checkpoint.enable_save=false"]
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    train_all(
        [
            Run(tiny_config, [*common, f"--training.output_dir={fp32}"], 2),
            Run(
                tiny_config, [*common, "--parallelism.reduce_dtype=bf16", f"--training.output_dir={bf16}"], 2
            ),
        ]
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
    step2 = one / "checkpoints" / "checkpoint-00000002"
    resume = [
        "--training.steps=4",
        "--checkpoint.enable_save=false",
        "--parallelism.ignored_modules=['model.embed_tokens']",
        f"--checkpoint.load_path={step2}",
        f"--training.output_dir={ignored}",
    ]
    train_all(
        [
            Run(tiny_config, ["--training.steps=4", f"--training.output_dir={one}"]),
            Run(tiny_config, resume, 2),
        ]
    )
    want, got = read_metrics(one)[2:], read_metrics(ignored)
    assert [r["step"] for r in got] == [3, 4]
    for x, y in zip(want, got, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)


# A small qwen3 for apply_fsdp's own offload policy.
OFFLOADED = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@contextlib.contextmanager
def _recorded_collectives() -> Iterator[list[tuple[str, torch.dtype, bool]]]:
    """(collective, dtype, in backward) of every FSDP all-gather and reduce-scatter meanwhile."""
    calls: list[tuple[str, torch.dtype, bool]] = []
    real_gather, real_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def gather(output_tensor, input_tensor, *args, **kwargs):
        calls.append(("all_gather", input_tensor.dtype, torch._C._current_graph_task_id() != -1))
        return real_gather(output_tensor, input_tensor, *args, **kwargs)

    def scatter(output, input, *args, **kwargs):  # noqa: A002 (torch's parameter names)
        calls.append(("reduce_scatter", input.dtype, torch._C._current_graph_task_id() != -1))
        return real_scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    try:
        yield calls
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real_gather, real_scatter


def _units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def _group(unit: torch.nn.Module):
    return unit._get_fsdp_state()._fsdp_param_group


def _uneven_batches(
    batches: Iterator[dict[str, torch.Tensor]], rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's rows, with rank 1's first 20 labels of each row masked: unequal token counts."""
    for batch in batches:
        if rank == 1:
            batch = {**batch, "labels": batch["labels"].clone()}
            batch["labels"][:, :20] = -100
        yield batch


def _effects_worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from meshforge.config import load_config
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply as fsdp
    from meshforge.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    config = Path(root) / "tiny.yaml"

    def one_step(name: str, *extra: str):
        overrides = ["--training.steps=1", "--checkpoint.enable_save=false", *extra]
        cfg = load_config(config, [*overrides, f"--training.output_dir={root}/{name}"])
        logs: list[str] = []
        trainer = Trainer(cfg, log=logs.append)
        trainer.setup()
        divisors: list[float] = []
        real_divisor = trainer._loss_normalizer

        def divisor(local_tokens, global_tokens):
            out = real_divisor(local_tokens, global_tokens)
            divisors.append(float(out))
            return out

        trainer._loss_normalizer = divisor
        trainer.data_iter = _uneven_batches(trainer.data_iter, rank)
        with _recorded_collectives() as calls:
            trainer.train_step()
        trainer.close()
        return trainer, calls, divisors, logs

    layers = [f"model.layers.{i}" for i in range(2)]

    # Defaults: fp32 reduce-scatter; layers reshard after forward (the last one excepted, its
    # backward follows at once), so backward all-gathers again; prefetch is FSDP's implicit
    # one unit each way (no explicit lists).
    trainer, calls, divisors, _ = one_step("default")
    units = _units(trainer.model)
    assert set(layers) <= set(units), sorted(units)
    assert {dtype for op, dtype, _ in calls if op == "reduce_scatter"} == {torch.float32}, calls
    assert _group(units[layers[0]]).mp_policy.reduce_dtype == torch.float32
    assert _group(units[layers[0]]).post_forward_mesh_info is not None
    assert any(op == "all_gather" and backward for op, _, backward in calls), calls
    assert all(
        not (s := units[n]._get_fsdp_state())._states_to_forward_prefetch
        and not s._states_to_backward_prefetch
        for n in layers
    )
    assert not isinstance(_group(units[layers[0]]).offload_policy, CPUOffloadPolicy)
    global_tokens = divisors[0]

    # parallelism.reduce_dtype: bf16 is the dtype the gradients are summed in.
    trainer, calls, _, _ = one_step("bf16", "--parallelism.reduce_dtype=bf16")
    scatters = [dtype for op, dtype, _ in calls if op == "reduce_scatter"]
    assert scatters and set(scatters) == {torch.bfloat16}, calls
    assert all(_group(u).mp_policy.reduce_dtype == torch.bfloat16 for u in _units(trainer.model).values())

    # ZeRO-2: the gathered weights stay from forward to backward, so backward gathers nothing.
    trainer, calls, _, _ = one_step("zero2", "--parallelism.data_parallel_shard_strategy=optim_grads")
    assert all(_group(u).post_forward_mesh_info is None for u in _units(trainer.model).values())
    assert any(op == "all_gather" for op, _, _ in calls), calls
    assert not any(op == "all_gather" and backward for op, _, backward in calls), calls

    # Prefetch depths along the hook_modules chain (3 layers: a depth of 2 shows).
    trainer, _, _, _ = one_step(
        "prefetch",
        "--model.num_hidden_layers=3",
        "--parallelism.num_to_forward_prefetch=2",
        "--parallelism.num_to_backward_prefetch=0",
        "--parallelism.hook_modules=['model.layers.{0-2}']",
    )
    units = _units(trainer.model)
    states = [units[f"model.layers.{i}"]._get_fsdp_state() for i in range(3)]
    assert states[0]._states_to_forward_prefetch == states[1:]
    assert states[1]._states_to_forward_prefetch == states[2:]
    assert all(s._states_to_backward_prefetch == [] for s in states)

    # Units by pattern: attention and MLP of each layer, not the layer.
    trainer, _, _, _ = one_step(
        "units", "--parallelism.fsdp_modules=['model.layers.{*}.self_attn', 'model.layers.{*}.mlp']"
    )
    units = _units(trainer.model)
    assert {f"{n}.self_attn" for n in layers} | {f"{n}.mlp" for n in layers} <= set(units)
    assert not set(layers) & set(units), sorted(units)

    # disable_gradient_division false: each rank divides by its own valid tokens times dp (the
    # mean of per-rank means); the default divides by the global count. Rank 1 has fewer.
    _, _, divisors, _ = one_step("rank_mean", "--parallelism.disable_gradient_division=false")
    local = torch.tensor(divisors[0] / world)
    counts = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(counts, local)
    assert float(sum(counts)) == global_tokens and counts[0] > counts[1], (counts, global_tokens)

    # cpu_offload on a CPU run: a documented no-op (said in the log). On an accelerator apply_fsdp
    # gives every unit FSDP's CPUOffloadPolicy (pinned host memory, which a CPU-only machine
    # cannot allocate: the policy is recorded here, the units built without it).
    trainer, _, _, logs = one_step("offload", "--parallelism.cpu_offload=true")
    assert any("parallelism.cpu_offload: no effect on cpu" in line for line in logs), logs
    policies = []
    real_shard = fsdp.fully_shard

    def recording_shard(module, **kwargs):
        policies.append(kwargs.pop("offload_policy", None))
        return real_shard(module, **kwargs)

    fsdp.fully_shard = recording_shard
    try:
        model = resolve_family("qwen3").build(OFFLOADED, device="cpu")
        fsdp.apply_fsdp(
            model,
            trainer.run.env.mesh.view("fsdp"),
            param_dtype=None,
            reduce_dtype=torch.float32,
            cpu_offload=True,
        )
    finally:
        fsdp.fully_shard = real_shard
    assert len(policies) == 3 and all(isinstance(p, CPUOffloadPolicy) for p in policies), policies


def test_fsdp_options_take_effect_in_the_trainer(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.format(data=corpus))
    run_workers(_effects_worker, 2, str(tmp_path))
