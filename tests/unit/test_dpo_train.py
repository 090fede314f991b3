"""`training.stage: dpo` end to end on a tiny Qwen3 (configs/qwen3/dpo_lora.yaml, in this process).

The policy starts equal to its reference (LoRA with B = 0: the adapters-off base; full fine-tuning:
a frozen copy built from the same seeded init), so the first loss is ln 2 and every reward is 0;
training on one fixed batch of 8 pairs then lowers the loss every step. Resuming a full
fine-tuning run (the reference rebuilt, the policy loaded) repeats the uninterrupted steps bitwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3" / "dpo_lora.yaml"
TINY = [
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.num_hidden_layers=2",
    "--model.num_attention_heads=2",
    "--model.num_key_value_heads=2",
    "--model.head_dim=32",
    "--train_dataset.cutoff_len=48",
    "--train_dataset.max_samples=8",  # one global batch: every step sees the same 8 pairs
    "--training.global_batch_size=8",
    "--training.local_batch_size=4",
    "--training.log_interval=1",
    "--checkpoint.save_interleaved_steps=100",
]
FULL = ["--lora_config=null", "--lr_scheduler.learning_rate=1e-3", "--kernels.chunk_loss_size=16"]
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.mark.parametrize(
    "tuning,extra,reference",
    [
        ("lora", ["--lr_scheduler.learning_rate=2e-2"], "the policy with LoRA adapters disabled"),
        ("full", FULL, "a frozen copy of the model, sharded as the policy"),
    ],
)
def test_first_loss_is_ln2_and_the_loss_falls(tmp_path, tuning, extra, reference):
    out = tmp_path / "run"
    run = train_one(
        CONFIG, [*TINY, *extra, "--training.steps=4", f"--training.output_dir={out}"], cwd=tmp_path
    )
    assert f"preference: sigmoid loss, beta 0.1; reference model: {reference}" in run.stdout
    records = read_metrics(out)
    first = records[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(first[key] == 0.0 for key in REWARDS)
    assert first["pairs"] == 8 and first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    losses = [r["loss"] for r in records]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert records[-1]["rewards/margins"] > 0 and records[-1]["rewards/accuracies"] > 0.5
    assert "rewards chosen" in run.stdout and "margin" in run.stdout  # the console line
    # The end-of-run picture's loss panel carries the reward margin on its second axis.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshforge.monitor.plot import plot_margin, plot_runs

    assert plot_runs([out], tmp_path / "curves.png").stat().st_size > 0

    fig, ax = plt.subplots()
    twin = plot_margin(ax, records, tuning, "C0")
    assert twin is not None and twin.get_ylabel() == "reward margin (dotted)"
    assert list(twin.lines[0].get_ydata()) == [r["rewards/margins"] for r in records]
    assert plot_margin(ax, [{"step": 1, "loss": 1.0}], tuning, "C0") is None  # not a preference run
    plt.close(fig)


def test_full_finetuning_resume_is_bitwise(tmp_path):
    whole, first = tmp_path / "whole", tmp_path / "first"
    base = [*TINY, *FULL, "--train_dataset.max_samples=16", "--training.steps=4"]
    train_one(CONFIG, [*base, f"--training.output_dir={whole}"], cwd=tmp_path)
    train_one(
        CONFIG,
        [*base, f"--training.output_dir={first}", "--checkpoint.save_interleaved_steps=2"],
        cwd=tmp_path,
    )
    resumed = tmp_path / "resumed"
    step2 = first / "checkpoints" / "checkpoint-00000002"
    train_one(
        CONFIG, [*base, f"--training.output_dir={resumed}", f"--checkpoint.load_path={step2}"], cwd=tmp_path
    )
    keys = ("loss", "grad_norm", "pairs", *REWARDS, "logps/chosen", "logps/rejected")
    want = [{k: r[k] for k in keys} for r in read_metrics(whole)]
    assert [{k: r[k] for k in keys} for r in read_metrics(resumed)] == want[2:]
    assert want[2]["rewards/margins"] != 0.0


def test_packed_pairs_train_from_ln2(tmp_path):
    """`train_dataset.packing`: several pairs per row; the loss is still the mean over pairs."""
    out = tmp_path / "run"
    packed = [
        "--train_dataset.packing=true",
        "--train_dataset.cutoff_len=128",
        "--train_dataset.max_samples=16",
        "--training.global_batch_size=2",
        "--training.local_batch_size=1",
    ]
    run = train_one(
        CONFIG, [*TINY, *packed, "--training.steps=2", f"--training.output_dir={out}"], cwd=tmp_path
    )
    assert "packed pair train rows of 256 tokens" in run.stdout
    records = read_metrics(out)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["pairs"] > 2  # more pairs than the step's 2 rows
    assert records[1]["loss"] != records[0]["loss"]


@pytest.mark.parametrize(
    "overrides,want",
    [
        ([], "dpo reference model: the policy with its LoRA adapters disabled: no extra weights"),
        (["--lora_config=null"], "dpo reference model: a frozen copy sharded as the policy: +0.01 GiB"),
        (["--training.pref_loss=simpo"], "dpo reference model: none (simpo is reference-free)"),
    ],
)
def test_validate_names_the_reference_model_cost(overrides, want):
    from meshforge.config import load_config
    from meshforge.parallel.plan import plan_lines

    lines = plan_lines(load_config(str(CONFIG), overrides), 2)
    assert any(line.startswith(want) for line in lines), lines


def test_data_preview_shows_pair_rows():
    from meshforge.config import load_config
    from meshforge.data.preview import build_preview_loader

    lines: list[str] = []
    _, loader = build_preview_loader(
        load_config(str(CONFIG), ["--train_dataset.max_samples=8"]), log=lines.append
    )
    batch = next(iter(loader))
    assert any("8 pair train rows of 256 tokens" in line for line in lines), lines
    assert batch["segment_ids"].max() == 2 and (batch["segment_ids"] == 2).any(axis=1).all()


def test_validation_pairs_are_evaluated(tmp_path):
    """`val_size` with dpo: the validation loss is the mean pair loss, with the validation rewards."""
    out = tmp_path / "run"
    extra = ["--train_dataset.max_samples=16", "--train_dataset.val_size=4", "--training.eval_interval=1"]
    run = train_one(
        CONFIG, [*TINY, *extra, "--training.steps=2", f"--training.output_dir={out}"], cwd=tmp_path
    )
    records = read_metrics(out)
    first = records[0]
    assert first["eval_pairs"] == 4 and "eval_tokens" not in first
    # Evaluated after the first update: no longer ln 2, and the rewards are the validation pairs'.
    assert math.isfinite(first["eval_loss"]) and first["eval_loss"] != pytest.approx(math.log(2), abs=1e-6)
    assert first["eval_rewards/margins"] != 0.0 and 0.0 <= first["eval_rewards/accuracies"] <= 1.0
    assert "eval step 1: eval_loss" in run.stdout and "over 4 pairs; rewards accuracy" in run.stdout


def test_tokenized_pairs_are_saved_reused_and_kept_from_sft(tmp_path):
    from meshforge.config import load_config
    from meshforge.data.preview import build_preview_loader

    tok = tmp_path / "tok"
    first, second = tmp_path / "first", tmp_path / "second"
    base = [*TINY, "--training.steps=1", f"--train_dataset.tokenized_path={tok}"]
    train_one(CONFIG, [*base, f"--training.output_dir={first}"], cwd=tmp_path)
    run = train_one(CONFIG, [*base, f"--training.output_dir={second}"], cwd=tmp_path)
    assert "loaded tokenized data from" in run.stdout
    assert (
        read_metrics(second)[0]["loss"]
        == read_metrics(first)[0]["loss"]
        == pytest.approx(math.log(2), abs=1e-6)
    )
    assert read_metrics(second)[0]["pairs"] == 8
    sft = load_config(str(CONFIG), ["--training.stage=sft", f"--train_dataset.tokenized_path={tok}"])
    with pytest.raises(ValueError, match="holds pair rows of a dpo run; this run"):
        build_preview_loader(sft)


def test_streamed_pairs_train_from_ln2(tmp_path):
    """`train_dataset.streaming`: pair rows encoded on the fly, the same first step."""
    out = tmp_path / "run"
    stream = ["--train_dataset.streaming=true", "--train_dataset.max_samples=null", "--training.steps=1"]
    run = train_one(CONFIG, [*TINY, *stream, f"--training.output_dir={out}"], cwd=tmp_path)
    assert "encoded on the fly into pair rows of 96 tokens" in run.stdout
    first = read_metrics(out)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["pairs"] == 8
