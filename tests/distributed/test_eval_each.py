"""Per-dataset evaluation (`train_dataset.eval_on_each_dataset`) in the trainer: 2 ranks = 1 process.

Whole trainer runs in-process (`train_all`: the one-process reference here, the 2-rank layouts,
FSDP data parallel and a 2-stage pipeline, in the shared rank pool).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow

SFT = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
NAMES = ("alpaca_demo", "chat_sample")
COMMON = [
    "--training.steps=2",
    "--training.log_interval=1",
    "--training.eval_interval=1",
    f"--train_dataset.eval_dataset={','.join(NAMES)}",
    "--train_dataset.eval_on_each_dataset=true",
    "--train_dataset.max_samples=48",
    "--checkpoint.enable_save=false",
]


def write_datasets(folder: Path) -> Path:
    """The demo's datasets plus a random sample of the multi-turn conversations (other data)."""
    folder.mkdir()
    info = json.loads((REPO / "assets" / "sft" / "dataset_info.json").read_text())
    for entry in info.values():
        entry["file_name"] = str((REPO / "assets" / "sft" / entry["file_name"]).resolve())
    info["chat_sample"] = {**info["conversations"], "num_samples": 40}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def test_per_dataset_eval_losses_of_two_ranks_equal_one_process(tmp_path: Path) -> None:
    one, dp, pp = tmp_path / "one", tmp_path / "dp", tmp_path / "pp"
    log = tmp_path / "dp.log"
    common = [*COMMON, f"--train_dataset.dataset_dir={write_datasets(tmp_path / 'data')}"]
    train_all(
        [
            Run(SFT, [*common, f"--training.output_dir={one}"]),
            Run(SFT, [*common, f"--training.output_dir={dp}"], nproc=2, log=log),
            Run(SFT, [*common, "--parallelism.pipeline_parallel=2", f"--training.output_dir={pp}"], nproc=2),
        ]
    )
    ref = read_metrics(one)
    assert [r["step"] for r in ref if "eval_loss" in r] == [1, 2]
    for record in ref:
        tokens = [record[f"eval_tokens/{name}"] for name in NAMES]
        losses = [record[f"eval_loss/{name}"] for name in NAMES]
        assert all(t > 0 for t in tokens) and losses[0] != pytest.approx(losses[1], rel=1e-4)
        # eval_loss is the token-weighted mean of the datasets' losses.
        assert record["eval_tokens"] == sum(tokens)
        weighted = sum(x * t for x, t in zip(losses, tokens, strict=True)) / sum(tokens)
        assert math.isclose(record["eval_loss"], weighted, rel_tol=1e-12)
    for run in (dp, pp):
        got = read_metrics(run)
        assert len(got) == len(ref)
        for x, y in zip(ref, got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
            assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)
            assert y["eval_tokens"] == x["eval_tokens"]
            for name in NAMES:
                assert y[f"eval_loss/{name}"] == pytest.approx(x[f"eval_loss/{name}"], rel=1e-5)
                assert y[f"eval_tokens/{name}"] == x[f"eval_tokens/{name}"]
    text = log.read_text()
    assert "each of 2 datasets on its own" in text
    assert "eval step 1: eval_loss" in text and "; eval_loss/chat_sample " in text
