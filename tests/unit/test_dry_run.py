"""`meshforge config validate --dry-run`: one whole step of one rank of an N-rank layout, in
this process, on fake tensors and torch's fake process group (`train/dry_run.py`).

Each layout runs the trainer's own build and step code; the seeded bugs are real bug classes
(a TP plan that misses a module, experts that do not split over EP, a stage boundary that
cuts a block, a dtype mismatch under mixed precision), each of which the dry run must report
with the layout and the module it failed in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from meshforge.config.loader import load_config
from meshforge.train.dry_run import DryRunError, DryRunReport, dry_run

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "configs/llama/tiny.yaml"
QWEN3_MOE = ROOT / "configs/qwen3_moe/tiny.yaml"
QWEN3_NEXT = ROOT / "configs/qwen3_next/tiny.yaml"
SMALL = [
    "--model.num_hidden_layers=2",
    "--training.local_batch_size=2",
    "--train_dataset.dataloader.seq_length=64",
]


def _run(config: Path, world: int, *overrides: str, rank: int | None = None) -> DryRunReport:
    cfg = load_config(config, [*SMALL, *overrides])
    return dry_run(cfg, world_size=world, rank=rank)


def _kinds(report: DryRunReport, dim: str) -> dict[str, int]:
    return {row.kind: row.count for row in report.collectives if dim in row.dim.split("/")}


def _local_param_bytes(world: int, *overrides: str) -> int:
    """Bytes of one rank's parameters, from the full model's size over its shards (fp32)."""
    from meshforge.parallel.plan import count_parameters

    cfg = load_config(LLAMA, [*SMALL, *overrides])
    _family, counts = count_parameters(cfg)
    return int(counts.total * 4 / world)


def test_tp_fsdp_step_reports_peak_collectives_and_save_plan() -> None:
    report = _run(LLAMA, 4, "--parallelism.tensor_parallel=2")
    assert report.lines()[0].startswith("dry run (rank ")
    assert "one step ok" in report.lines()[0]
    tp = _kinds(report, "tp")
    assert tp.get("all-gather", 0) > 0 and tp.get("reduce-scatter", 0) > 0  # sequence parallelism
    fsdp = _kinds(report, "fsdp")
    assert fsdp.get("all-gather", 0) > 0 and fsdp.get("reduce-scatter", 0) > 0
    assert report.save_plan_items > 0
    # Weights, gradients and AdamW's two moments of this rank's shard are all live at the update.
    assert report.peak_bytes > 4 * _local_param_bytes(4)
    # The allocator replay saw the same allocations: it maps at least the live peak, in pages.
    assert report.reserved_bytes >= report.peak_bytes and report.reserved_bytes % (2 << 20) == 0
    compute, live, side = report.reserved_split
    assert compute >= live > 0 and side > 0 and compute + side == report.reserved_bytes  # FSDP's streams
    assert any(line.startswith("  reserved by the caching allocator") for line in report.lines())


@pytest.mark.slow
def test_expert_parallel_step_exchanges_tokens_all_to_all() -> None:
    report = _run(QWEN3_MOE, 4, "--parallelism.expert_parallel=2")
    assert _kinds(report, "ep").get("all-to-all", 0) > 0
    assert any("balanced" in note for note in report.notes)


@pytest.mark.slow
def test_pipeline_last_stage_and_context_parallel_steps_run() -> None:
    last = _run(LLAMA, 2, "--parallelism.pipeline_parallel=2", "--training.global_batch_size=4", rank=1)
    pp = _kinds(last, "pp")
    assert pp.get("send", 0) > 0 and pp.get("recv", 0) > 0
    cp = _run(LLAMA, 2, "--parallelism.context_parallel=2")
    assert cp.peak_bytes > 0
    hybrid = _run(
        LLAMA,
        4,
        "--parallelism.context_parallel=4",
        "--parallelism.context_parallel_method=hybrid",
        "--parallelism.ulysses_degree_in_cp=2",
    )
    # Hybrid CP's sub-groups are named, not left as "group N".
    assert _kinds(hybrid, "cp:ring").get("all-to-all", 0) > 0
    assert _kinds(hybrid, "cp:ulysses").get("all-to-all", 0) > 0
    assert not any(row.dim.startswith("group ") for row in hybrid.collectives)


def test_full_recompute_of_a_hybrid_moe_model_peaks_as_predicted() -> None:
    """Qwen3-Next, every layer recomputed: backward frees each recomputed layer (its MoE records
    stay the forward's, `memory/recompute.py`), so the measured peak is the predicted one; it was
    1.3x when the recomputed Gated DeltaNet intermediates piled up through backward."""
    cfg = load_config(
        QWEN3_NEXT,
        [
            "--train_dataset.dataloader.seq_length=256",
            "--recompute.mode=full",
            "--recompute.full_recompute_layer=[0-3]",
        ],
    )
    report = dry_run(cfg, world_size=1)
    assert report.predicted_peak_bytes
    assert 0.9 < report.peak_bytes / report.predicted_peak_bytes < 1.1, (
        report.peak_bytes,
        report.predicted_peak_bytes,
    )


def _without_o_proj(plan: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def seeded(model: torch.nn.Module, **kwargs: Any) -> dict[str, Any]:
        return {k: v for k, v in plan(model, **kwargs).items() if not k.endswith("o_proj")}

    return seeded


def test_seeded_tp_plan_missing_a_module_is_reported_with_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshforge.models.llama.parallelize as llama_tp

    monkeypatch.setattr(llama_tp, "checked_tp_plan", _without_o_proj(llama_tp.checked_tp_plan))
    with pytest.raises(DryRunError, match=r"tp=2.*failed in module model\.layers\.0\.self_attn"):
        _run(LLAMA, 2, "--parallelism.tensor_parallel=2")


@pytest.mark.slow
def test_seeded_uneven_expert_split_is_reported_by_key() -> None:
    # 8 experts over 3 expert-parallel ranks.
    with pytest.raises((ValueError, DryRunError), match="expert_parallel"):
        _run(QWEN3_MOE, 3, "--parallelism.expert_parallel=3", "--training.global_batch_size=6")


@pytest.mark.slow
def test_seeded_stage_boundary_inside_a_moe_block_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split that leaves a block's sparse feed-forward off the stage that runs the block."""
    import meshforge.parallel.pipeline as pipeline_package

    original = pipeline_package.split_model

    def cut_inside_block(model: torch.nn.Module, **kwargs: Any) -> Any:
        split = original(model, **kwargs)
        last = split.stages[0].layer_keys[-1]
        del model.get_submodule(f"model.layers.{last}")._modules["mlp"]
        return split

    monkeypatch.setattr(pipeline_package, "split_model", cut_inside_block)
    with pytest.raises(DryRunError, match=r"pp=2.*failed in module model\.layers\.0"):
        _run(QWEN3_MOE, 2, "--parallelism.pipeline_parallel=2", "--training.global_batch_size=4", rank=0)


@pytest.mark.slow
def test_seeded_dtype_mismatch_under_mixed_precision_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm that hands float32 to bf16 projections (a custom kernel that forgets to cast back)."""
    from meshforge.models.common import norms

    forward = norms.RMSNorm.forward

    def float32_out(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return forward(self, x).float()  # type: ignore[arg-type]

    monkeypatch.setattr(norms.RMSNorm, "forward", float32_out)
    with pytest.raises(DryRunError, match=r"failed in module model\.layers\.0\.self_attn\.q_proj.*dtype"):
        _run(LLAMA, 2, "--model.compute_dtype=bfloat16", "--parallelism.param_dtype=bfloat16")


def test_cli_prints_the_report_and_refuses_pair_stages(capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.cli.config import main

    args = ["validate", str(LLAMA), "--world-size", "2", "--no-path-checks", "--dry-run", *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dry run (rank 0 of 2, cpu): one step ok in" in out
    assert "collectives on " in out and "checkpoint: DCP save plan of" in out
    assert "reserved by the caching allocator (expandable segments):" in out
    dpo = ROOT / "configs/qwen3/dpo_lora.yaml"
    cp = ["--parallelism.context_parallel=2"]
    assert main(["validate", str(dpo), "--world-size", "2", "--no-path-checks", "--dry-run", *cp]) == 2
    assert (
        "not supported yet: a dry run of training.stage: dpo with context parallelism"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        ("dpo_lora.yaml", []),
        ("dpo_lora.yaml", ["--parallelism.pipeline_parallel=2", "--training.global_batch_size=8"]),
        ("dpo_lora.yaml", ["--lora_config=null"]),  # a frozen reference copy
        ("rm_lora.yaml", []),
    ],
)
def test_preference_stages_dry_run_as_predicted(config: str, overrides: list[str]) -> None:
    """The pair stages find their answer tokens from the synthetic batch's host values
    (`utils/fake_values.py`), through the pipeline's micro-batch split too."""
    cfg = load_config(ROOT / "configs/qwen3" / config, ["--checkpoint.enable_save=false", *overrides])
    report = dry_run(cfg, world_size=4)
    assert report.predicted_peak_bytes is not None
    assert 0.8 <= report.peak_bytes / report.predicted_peak_bytes <= 1.25, report.lines()[0]


EXAMPLES = ROOT / "configs/examples"
DATA = ROOT / "tests/data"


def _deepseek_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "deepseek_v3"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "deepseek_v3_config.json").read_text())
    return folder


# Each example at its documented world size, its depth cut to what its layout needs (the
# full-depth runs are benchmarks/dry_run_examples.py's).
EXAMPLE_RUNS: dict[str, tuple[int, list[str]]] = {
    "llama3_1_70b_tp8_fsdp.yaml": (
        64,
        ["--model.num_hidden_layers=2", "--recompute.full_recompute_layer=[0-1]"],
    ),
    "qwen3_30b_a3b_sft_ep8.yaml": (
        8,
        ["--model.num_hidden_layers=2", "--recompute.full_recompute_layer=[0-1]"],
    ),
    "qwen3_8b_pretrain_fsdp8.yaml": (
        8,
        ["--model.num_hidden_layers=2", "--recompute.full_recompute_layer=[0-1]"],
    ),
    "qwen3_next_80b_a3b_ep8_fsdp32.yaml": (
        32,
        ["--model.num_hidden_layers=4", "--recompute.full_recompute_layer=[0-3]"],
    ),
    "deepseek_v3_671b.yaml": (
        256,
        [
            "--model.num_hidden_layers=8",
            "--parallelism.pipeline_parallel_layers_per_stage=auto",
            "--recompute.full_recompute_layer=[0-7]",
        ],
    ),
}
MODEL_FOLDERS = {
    "llama3_1_70b_tp8_fsdp.yaml": "llama3_1_70b",
    "qwen3_30b_a3b_sft_ep8.yaml": "qwen3_30b_a3b",
    "qwen3_8b_pretrain_fsdp8.yaml": "qwen3_8b",
    "qwen3_next_80b_a3b_ep8_fsdp32.yaml": "qwen3_next_80b_a3b",
}


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_example_dry_runs_at_its_documented_world_size(name: str, tmp_path: Path) -> None:
    world, overrides = EXAMPLE_RUNS[name]
    folder = DATA / MODEL_FOLDERS[name] if name in MODEL_FOLDERS else _deepseek_folder(tmp_path)
    cfg = load_config(EXAMPLES / name, [f"--model.model_name_or_path={folder}", *overrides])
    report = dry_run(cfg, world_size=world)
    assert report.world_size == world and report.peak_bytes > 0
    assert report.collectives and report.save_plan_items > 0
