"""DeepSeek-V3 as published: its config.json (671B, 37B active, FP8, YaRN, one MTP layer)
validates and plans at 256 ranks through configs/examples/deepseek_v3_671b.yaml (PP + EP +
FSDP with MTP), and the predicted memory per rank fits an 80 GB device."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from meshforge.utils.hardware import hardware
from tests.conftest import REPO, meshforge_cmd, worker_env

EXAMPLE = REPO / "configs" / "examples" / "deepseek_v3_671b.yaml"
PUBLISHED = REPO / "tests" / "data" / "deepseek_v3_config.json"
DEVICE_BYTES = hardware("h100").memory_gib * 2**30  # an 80 GB device's usable bytes


def test_example_opens_with_its_launch_command() -> None:
    head = EXAMPLE.read_text().split("\n\n", 1)[0]
    assert "torchrun --nnodes 32 --nproc-per-node 8" in head
    assert "meshforge train --config configs/examples/deepseek_v3_671b.yaml" in head


@pytest.mark.procs
def test_published_config_validates_and_plans_at_256_ranks_within_80gb(tmp_path: Path) -> None:
    folder = tmp_path / "DeepSeek-V3"
    folder.mkdir()
    shutil.copy(PUBLISHED, folder / "config.json")
    cmd = meshforge_cmd(
        "config",
        "validate",
        str(EXAMPLE),
        "--world-size",
        "256",
        "--no-path-checks",  # the cluster's data folder
        f"--model.model_name_or_path={folder}",
        "--model.tokenizer_name_or_path=meshforge://assets/tokenizer",
    )
    proc = subprocess.run(cmd, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "valid for world size 256 (0 warning(s))" in out
    assert "pp=8" in out and "experts over ep 32" in out and "dense FSDP over 32" in out
    # 671B + the MTP block (one more MoE layer; the published card's 685B also counts its copies
    # of the embedding and head, which meshforge shares).
    total = float(re.search(r"deepseek_v3, ([0-9.]+)B parameters", out)[1])
    assert 680 < total < 686
    peak = float(re.search(r"predicted peak per rank .*= ([0-9.]+) GiB", out)[1])
    assert 0 < peak * 1024**3 < DEVICE_BYTES, out
