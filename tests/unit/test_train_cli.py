"""End-to-end `meshforge train`: the built-in demo from another directory, outputs, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import meshforge_here, read_metrics

# Every test here runs a meshforge command: the entry point itself (`python -m meshforge`) in a
# process, the others in this one (`meshforge_here`: the same `main`, its exit code and output).
pytestmark = pytest.mark.slow


def _train(config: Path, overrides: list[str], *, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = meshforge_here("train", "--config", str(config), *overrides, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.procs
def test_demo_runs_from_any_directory_and_writes_its_outputs(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    proc = subprocess.run(
        [sys.executable, "-m", "meshforge", "train", "--training.steps=3", f"--training.output_dir={out}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built-in demo" in proc.stdout
    assert "step 3/3" in proc.stdout and "tok/s" in proc.stdout
    assert "Done: 3 steps" in proc.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s", "memory_bytes"):
        assert key in records[0]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["training"]["steps"] == 3
    assert resolved["model"]["hidden_size"] == 256
    step_dir = out / "checkpoints" / "checkpoint-00000003"
    assert (step_dir / "COMPLETE").is_file()
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["tokens_seen"] == 3 * records[0]["tokens"]


def test_training_loss_falls_and_checkpoints_are_pruned(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(
        tiny_config,
        ["--training.steps=12", f"--training.output_dir={out}", "--checkpoint.save_max=2"],
        cwd=tmp_path,
    )
    records = read_metrics(out)
    assert records[-1]["loss"] < records[0]["loss"] * 0.9
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["checkpoint-00000010", "checkpoint-00000012"]


def test_unsupported_feature_is_refused_at_start(tiny_config: Path, tmp_path: Path) -> None:
    proc = meshforge_here(
        "train", "--config", str(tiny_config), "--parallelism.enable_mc2=true", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "not supported yet: parallelism.enable_mc2" in proc.stderr
    assert "Traceback" not in proc.stderr


def _refused(config: Path, cwd: Path, *overrides: str) -> str:
    proc = meshforge_here("train", "--config", str(config), *overrides, cwd=cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_bad_override_names_the_key(tiny_config: Path, tmp_path: Path) -> None:
    err = _refused(tiny_config, tmp_path, "--training.stpes=3")
    assert "stpes" in err and "steps" in err
    err = _refused(tiny_config, tmp_path, "--model.num_hiden_layers=2")
    assert "model.num_hiden_layers" in err and "num_hidden_layers" in err


def test_model_must_fit_the_data(tiny_config: Path, tmp_path: Path) -> None:
    err = _refused(tiny_config, tmp_path, "--model.max_position_embeddings=16")
    assert "model.max_position_embeddings" in err and "32" in err
    err = _refused(tiny_config, tmp_path, "--model.vocab_size=100")
    assert "model.vocab_size" in err
    err = _refused(tiny_config, tmp_path, "--training.global_batch_size=1")
    assert "training.global_batch_size" in err


def test_resume_into_the_same_folder_and_weights_only_loading(tiny_config: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    tb = tmp_path / "tb"
    _train(
        tiny_config,
        ["--training.steps=4", f"--training.output_dir={run}", f"--monitor.tensorboard.output_dir={tb}"],
        cwd=tmp_path,
    )
    first = read_metrics(run)
    assert list(tb.glob("events.out.tfevents.*")), "TensorBoard wrote no event file"

    # Resume from the step-2 folder into the same run folder: metrics.jsonl keeps steps 1-2 and
    # continues; the resumed steps reproduce the original ones.
    step2 = run / "checkpoints" / "checkpoint-00000002"
    _train(
        tiny_config,
        ["--training.steps=4", f"--training.output_dir={run}", f"--checkpoint.load_path={step2}"],
        cwd=tmp_path,
    )
    again = read_metrics(run)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]

    # Weights only: a fresh run (step 1, fresh schedule) starting from the trained weights.
    fresh = tmp_path / "fresh"
    proc = _train(
        tiny_config,
        [
            "--training.steps=1",
            f"--training.output_dir={fresh}",
            f"--checkpoint.load_path={run / 'checkpoints'}",
            "--checkpoint.no_load_optim=true",
        ],
        cwd=tmp_path,
    )
    assert "no_load_optim" in proc.stdout
    weights_only = read_metrics(fresh)
    assert weights_only[0]["step"] == 1 and weights_only[0]["lr"] == first[0]["lr"]
    assert weights_only[0]["loss"] < first[0]["loss"] - 0.05


def test_checkpoint_without_optimizer_cannot_be_resumed_exactly(tiny_config: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(
        tiny_config,
        ["--training.steps=2", f"--training.output_dir={run}", "--checkpoint.no_save_optim=true"],
        cwd=tmp_path,
    )
    proc = meshforge_here(
        "train",
        "--config",
        str(tiny_config),
        "--training.steps=3",
        f"--training.output_dir={tmp_path / 'again'}",
        f"--checkpoint.load_path={run / 'checkpoints'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "checkpoint.load_path" in proc.stderr and "no_load_optim" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_disabled_saving_writes_no_checkpoint(tiny_config: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(
        tiny_config,
        ["--training.steps=2", f"--training.output_dir={run}", "--checkpoint.enable_save=false"],
        cwd=tmp_path,
    )
    assert not (run / "checkpoints").exists()
    assert "no checkpoint saved" in proc.stdout


def test_preprocess_is_a_meshforge_command(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "hello world"}\n{"text": "a second document"}\n')
    proc = meshforge_here(
        "preprocess",
        "--input",
        str(corpus),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer",
        "meshforge://assets/tokenizer",
        "--append-eod",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "out_text_document.idx").is_file() and (tmp_path / "out_text_document.bin").is_file()
