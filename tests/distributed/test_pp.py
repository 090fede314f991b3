"""Pipeline parallelism on 2 processes (gloo) equals one process: losses, gradients, tied weights.

One launch runs every layout against a single-process reference with the same weights and data:
gpipe, 1f1b and interleaved (2 stages per rank) with uneven layer splits, tied and untied
embeddings, packed documents (``segment_ids`` must reach every stage), and one layout whose
model is FSDP-wrapped (on a 1-rank data mesh) and materialised by name, so the tied head on
the last rank starts from its own seed and must be synced from the embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._compare import assert_close
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

WORLD = 2
VOCAB, SEQ, MB, N_MICRO = 64, 8, 2, 4
RTOL = 1e-5

# (name, schedule, interleave, layers_per_stage, tied, fsdp)
CASES = [
    ("gpipe auto tied", "gpipe", 1, "auto", True, False),
    ("1f1b uneven untied", "1f1b", 1, ["0", "1-4"], False, False),
    ("interleaved uneven tied", "interleaved", 2, ["0,3", "1-2,4"], True, False),
    ("interleaved index lists untied", "interleaved1f1b", 2, [[0, 1, 3], [2, 4]], False, False),
    ("1f1b fsdp materialised tied", "1f1b", 1, ["0-2", "3-4"], True, True),
    # Zero bubble (separate input- and weight-gradient passes); zbv puts both ends on rank 0.
    ("interleaved zero bubble tied", "zero_bubble", 2, ["0,3", "1-2,4"], True, False),
    ("zbv tied", "zbv", 2, ["0,4", "1-2,3"], True, False),
    # The weight-gradient pass of zero bubble on FSDP's unsharded parameters.
    ("interleaved zero bubble fsdp untied", "zero_bubble", 2, ["0-1,3", "2,4"], False, True),
]


def _args(tied: bool):
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N_MICRO):
        ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels[:, : i % 3] = -100
        # Row 0 packs two documents; row 1 is one document with padding at the end.
        seg = torch.tensor([[1] * 3 + [2] * (SEQ - 3), [1] * (SEQ - 2) + [0] * 2])
        out.append({"input_ids": ids, "labels": labels, "segment_ids": seg})
    return out


def _build(tied: bool, fsdp_mesh):
    """The full model: weights from build_qwen3's fixed seeds, or materialised by name."""
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.qwen3.model import build_qwen3

    if fsdp_mesh is None:
        return build_qwen3(_args(tied), device="cpu")
    model = build_qwen3(_args(tied), device="meta")
    materialize_and_init(model, device=torch.device("cpu"), seed=11, init_fn=model.init_full_parameter_)
    return model


def _reference(tied: bool, fsdp: bool, micro, steps: int = 2):
    """Per step: CE sum and gradients by name (tied head under both names); final weights."""
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    model = _build(tied, object() if fsdp else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        for mb in micro:
            ce = cross_entropy_sum(model(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            (ce / tokens).backward()
            total += ce.detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        history.append((total, grads))
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        final_ce = sum(
            cross_entropy_sum(model(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            for mb in micro
        )
    return history, (weights, final_ce), tokens


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run_case(rank: int, case, pp_mesh, dp_mesh) -> None:
    from meshforge.parallel.fsdp import apply_fsdp
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name, schedule, interleave, spec, tied, fsdp = case
    micro = _micro_batches()
    history, (final, final_ce), tokens = _reference(tied, fsdp, micro)

    model = _build(tied, dp_mesh if fsdp else None)
    if fsdp:
        from meshforge.models.materialize import materialize_and_init
        from meshforge.models.qwen3.model import build_qwen3

        model = build_qwen3(_args(tied), device="meta")
    split = split_model(
        model, pp_rank=rank, pp_size=WORLD, layers_per_stage=spec, interleave=interleave, schedule=schedule
    )
    if fsdp:
        apply_fsdp(split.model, dp_mesh, param_dtype=None, reduce_dtype=torch.float32, pipeline_parallel=True)
        materialize_and_init(
            split.model, device=torch.device("cpu"), seed=11, init_fn=split.model.init_full_parameter_
        )
    elif split.tied_across_ranks and split.has_last:
        # Build-time sync must overwrite whatever the head copy holds.
        with torch.no_grad():
            split.model.lm_head.weight.zero_()
    opt = torch.optim.AdamW(split.model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = build_pipeline(
        split, split.model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule=schedule
    )
    for step, (want_ce, want_grads) in enumerate(history):
        opt.zero_grad()
        ce = pipe.step(micro, tokens)
        assert ce.dim() == 0 and ce.dtype == torch.float32 and not ce.requires_grad
        assert_close(ce, want_ce, floor=1e-6, what=f"[{name}] step {step} CE sum on rank {rank}")
        for n, p in split.model.named_parameters():
            assert p.grad is not None, f"[{name}] {n} has no grad"
            assert_close(_full(p.grad), want_grads[n], floor=1e-6, what=f"[{name}] step {step} grad {n}")
        opt.step()
    for n, p in split.model.named_parameters():
        assert_close(_full(p.detach()), final[n], floor=1e-6, what=f"[{name}] final weight {n}")
    # Forward-only evaluation after training; then one more training step still runs.
    assert_close(pipe.evaluate(micro), final_ce, floor=1e-6, what=f"[{name}] evaluate CE sum on rank {rank}")
    opt.zero_grad()
    assert torch.isfinite(pipe.step(micro, tokens))
    with pytest.raises(ValueError, match=r"micro-batches of shape \[\(2, 4\)\] after \(2, 8\)"):
        pipe.step([{k: v[:, :4] for k, v in mb.items()} for mb in micro], tokens)
    if split.tied_across_ranks:
        # The two copies of the tied weight are still bit-identical across the ranks.
        inner = split.model.model
        mine = _full(inner.embed_tokens.weight if split.has_first else split.model.lm_head.weight).detach()
        both = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(both, mine.contiguous())
        assert torch.equal(both[0], both[1]), f"[{name}] tied copies differ"


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp"))
    for case in CASES:
        torch.manual_seed(0)
        _run_case(rank, case, mesh["pp"], mesh["dp"])


def test_pp2_schedules_equal_one_process() -> None:
    run_workers(_worker, WORLD)


def test_trainer_pp2_equals_one_process(tiny_config: Path, tmp_path: Path) -> None:
    """`meshforge train`, 5 steps: pp2 gpipe / 1f1b / interleaved (uneven), dp2+pp2, tp2+pp2 vs 1 process."""
    from tests.conftest import read_metrics

    common = ["--training.steps=5", "--model.num_hidden_layers=5", "--checkpoint.enable_save=false"]
    pp = "--parallelism.pipeline_parallel=2"
    layouts = {
        # 'auto' needs the layers divisible by the stages (config rule), hence explicit splits.
        "gpipe": (
            2,
            [
                pp,
                "--parallelism.pipeline_parallel_schedule=gpipe",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-2","3-4"]',
            ],
        ),
        "1f1b": (
            2,
            [
                pp,
                "--parallelism.pipeline_parallel_schedule=1f1b",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-1","2-4"]',
            ],
        ),
        "interleaved": (
            2,
            [
                pp,
                "--parallelism.pipeline_parallel_schedule=interleaved",
                "--parallelism.pipeline_parallel_interleave_num=2",
                '--parallelism.pipeline_parallel_layers_per_stage=["0,3","1-2,4"]',
            ],
        ),
        # FSDP over the data ranks of each stage; one micro-batch per data rank (gpipe allows it).
        "dp2_pp2": (
            4,
            [
                pp,
                "--parallelism.pipeline_parallel_schedule=gpipe",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-1","2-4"]',
            ],
        ),
        # The chunked loss on the last stage (kernels.chunk_loss_size) against one process with it.
        "1f1b_chunked": (
            2,
            [
                pp,
                "--parallelism.pipeline_parallel_schedule=1f1b",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-1","2-4"]',
                "--kernels.chunk_loss_size=8",
            ],
        ),
        # TP+SP inside each stage: the hidden states between stages hold half of each row.
        "tp2_pp2": (
            4,
            [
                pp,
                "--parallelism.tensor_parallel=2",
                "--parallelism.sequence_parallel=true",
                "--parallelism.enable_loss_parallel=true",
                "--parallelism.pipeline_parallel_schedule=1f1b",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-2","3-4"]',
            ],
        ),
    }
    runs = [Run(tiny_config, [*common, f"--training.output_dir={tmp_path / 'one'}"])]
    # The 2-rank layouts first, then the 4-rank ones: one spawn for each world size.
    for name, (nproc, overrides) in sorted(layouts.items(), key=lambda item: item[1][0]):
        runs.append(
            Run(tiny_config, [*common, *overrides, f"--training.output_dir={tmp_path / name}"], nproc)
        )
    train_all(runs)
    want = read_metrics(tmp_path / "one")
    assert len(want) == 5
    for name in layouts:
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == [1, 2, 3, 4, 5], name
        for a, b in zip(want, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (name, a["step"])


def test_pp2_checkpoint_resumes_in_one_process(tiny_config: Path, tmp_path: Path) -> None:
    """A pp2 checkpoint (global parameter names on each stage) continues in one process, same losses."""
    from tests.conftest import read_metrics

    # Untied: with tied embeddings the head copy's optimizer state does not map yet (see readme).
    common = [
        "--training.steps=4",
        "--checkpoint.save_interleaved_steps=2",
        "--model.tie_word_embeddings=false",
        # The pp run exports from its final checkpoint; both exports must hold the same weights.
        "--checkpoint.save_hf_weights=true",
    ]
    pp, one = tmp_path / "pp", tmp_path / "one"
    step2 = pp / "checkpoints" / "checkpoint-00000002"
    train_all(
        [
            Run(
                tiny_config, [*common, f"--training.output_dir={pp}", "--parallelism.pipeline_parallel=2"], 2
            ),
            Run(tiny_config, [*common, f"--training.output_dir={one}", f"--checkpoint.load_path={step2}"]),
        ]
    )
    a, b = read_metrics(pp), read_metrics(one)
    assert [r["step"] for r in b] == [3, 4]
    for x, y in zip(a[2:], b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    from safetensors.torch import load_file

    exported = load_file(pp / "hf" / "model.safetensors")
    reference = load_file(one / "hf" / "model.safetensors")
    assert exported.keys() == reference.keys() and "lm_head.weight" in exported
    for key, tensor in reference.items():
        torch.testing.assert_close(exported[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
