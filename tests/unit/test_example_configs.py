"""Every runnable example under configs/ trains a few steps as `meshforge train` runs it (config
loading with overrides, then the trainer, in this process: the command line itself is
`test_train_cli.py`'s); the real-size examples under configs/examples/ plan on their world size and
fit an 80 GB device.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from meshforge.utils.hardware import hardware
from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import train_one

REAL_SIZE = REPO / "configs" / "examples"
# configs/examples/ name published models and GPU clusters: they are planned below, not trained here.
EXAMPLES = sorted(
    p for p in (REPO / "configs").rglob("*.yaml") if p.name != "demo.yaml" and REAL_SIZE not in p.parents
)
#: Real-size example -> (world size, its published config.json folder under tests/data).
REAL_SIZE_WORLDS = {
    "qwen3_8b_pretrain_fsdp8.yaml": (8, "qwen3_8b"),
    "qwen3_30b_a3b_sft_ep8.yaml": (8, "qwen3_30b_a3b"),
    "llama3_1_70b_tp8_fsdp.yaml": (64, "llama3_1_70b"),
    "qwen3_next_80b_a3b_ep8_fsdp32.yaml": (32, "qwen3_next_80b_a3b"),
}
DEVICE_BYTES = hardware("h100").memory_gib * 2**30  # an 80 GB device's usable bytes


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: str(p.relative_to(REPO / "configs")))
@pytest.mark.slow  # twelve whole trainings
def test_example_config_trains(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_one(
        config,
        [
            "--training.steps=5",
            "--training.log_interval=1",
            f"--training.output_dir={out}",
            "--checkpoint.save_interleaved_steps=5",
        ],
        cwd=tmp_path,
    )
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    if {"qwen3_moe", "gpt_oss"} & set(config.parts):
        # The router loss is logged under its own key, not mixed into `loss`.
        assert all(r["aux_loss"] > 0 for r in records)
    assert (out / "checkpoints" / "checkpoint-00000005" / "COMPLETE").is_file()


@pytest.mark.slow  # builds each published model on the meta device and traces a micro-batch
@pytest.mark.parametrize("name", sorted(REAL_SIZE_WORLDS))
def test_real_size_example_plans_and_fits_80gb(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from meshforge.cli.main import main

    path = REAL_SIZE / name
    world, model = REAL_SIZE_WORLDS[name]
    head = path.read_text().split("\n\n", 1)[0]
    # The comment opens with the launch command and the validate line this test runs.
    assert re.search(
        rf"torchrun .*--nproc-per-node 8 .*-m meshforge train --config configs/examples/{name}",
        head.replace("\\\n#", ""),
    ), head
    assert f"--world-size {world} --no-path-checks" in head and f"tests/data/{model}" in head
    published = REPO / "tests" / "data" / model
    status = main(
        [
            "config",
            "validate",
            str(path),
            "--world-size",
            str(world),
            "--no-path-checks",  # the data folders of the cluster it is for
            f"--model.model_name_or_path={published}",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"valid for world size {world}" in out and "not estimated" not in out, out
    peak = re.search(r"predicted peak per rank .*= ([0-9.]+) GiB", out)
    assert peak is not None, out
    assert float(peak.group(1)) * 2**30 <= DEVICE_BYTES, out
    assert "recompute full" in out, out
