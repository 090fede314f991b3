"""`monitor.moe_monitor` and `monitor.train_state` in 1 process, dp2 + ep2 and pp2: the same numbers.

Expert counts are integers summed over the data and expert ranks: they must be equal, and each
layer's counts sum to tokens x num_experts_per_tok. Train-state values: the per-parameter norms
equal the 1-process ones; the ranks' loss shares add up to the loss and their squared gradient
norms to the squared global norm. The 2-rank runs share one spawn of gloo processes; the
single-process runs run in the test's process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import read_metrics, train_here
from tests.distributed._spawn import run_workers, train_runs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TOP_K = 2
TRAIN = [
    "--training.steps=4",
    "--training.deterministic=true",
    "--training.local_batch_size=2",
    "--training.log_interval=2",
    "--model.num_hidden_layers=3",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.moe_intermediate_size=32",
    "--model.num_experts=4",
    f"--model.num_experts_per_tok={TOP_K}",
    "--model.head_dim=16",
    "--train_dataset.dataloader.seq_length=32",
    "--lr_scheduler.warmup_steps=1",
    "--checkpoint.enable_save=false",
    "--monitor.moe_monitor.save_tokens_per_expert_interval=2",
    "--monitor.moe_monitor.target_layers=[0,2]",
    "--monitor.train_state.local_norm=['*embed_tokens*','*layers.1.mlp.experts*']",
    "--monitor.train_state.local_loss=true",
    "--monitor.train_state.device_norm=true",
    "--monitor.train_state.device_loss=true",
    "--training.log_cpu_memory=true",
]


def _counts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "moe" / "tokens_per_expert.jsonl").read_text().splitlines()]


def test_moe_counts_and_train_state_agree_between_one_process_ep2_and_pp2(tmp_path: Path) -> None:
    config = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
    one, ep2 = tmp_path / "one", tmp_path / "ep2"
    train_here(config, [*TRAIN, f"--training.output_dir={one}"])
    # pp2: the stages' first-step shape inference runs the MoE layers too and must not count.
    pp2 = tmp_path / "pp2"
    runs = [
        (str(config), [*TRAIN, "--parallelism.expert_parallel=2", f"--training.output_dir={ep2}"]),
        (
            str(config),
            [
                *TRAIN,
                "--parallelism.pipeline_parallel=2",
                '--parallelism.pipeline_parallel_layers_per_stage=["0-1","2"]',
                f"--training.output_dir={pp2}",
            ],
        ),
    ]
    run_workers(train_runs, 2, runs, timeout=600)
    counts_one, counts_ep2 = _counts(one), _counts(ep2)
    assert [(c["step"], c["layer"]) for c in counts_one] == [(2, 0), (2, 2), (4, 0), (4, 2)]
    assert counts_ep2 == counts_one
    assert _counts(pp2) == counts_one
    records_one, records_ep2 = read_metrics(one), read_metrics(ep2)
    for line in counts_one:
        record = records_one[line["step"] - 1]
        assert sum(line["counts"]) == record["tokens"] * TOP_K
        ratio = max(line["counts"]) / (sum(line["counts"]) / len(line["counts"]))
        assert record[f"moe_load_ratio/layer{line['layer']}"] == pytest.approx(ratio, rel=1e-12)
    norms = ["local_norm/model.embed_tokens.weight", "local_norm/model.layers.1.mlp.experts.gate_up_proj"]
    for a, b in zip(records_one, records_ep2, strict=True):
        logged = a["step"] in (1, 2, 4)
        assert ("moe_max_load_ratio" in a) == (a["step"] % 2 == 0)
        assert (norms[0] in a) == logged and (norms[0] in b) == logged
        assert a["cpu_memory_bytes"] > 0 and b["cpu_memory_peak_bytes"] >= b["cpu_memory_bytes"]
        if not logged:
            continue
        assert sorted(k for k in a if k.startswith("local_norm/")) == sorted(
            k for k in b if k.startswith("local_norm/")
        )
        for key in (k for k in a if k.startswith("local_norm/")):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        # One process: its own loss and norm are the step's.
        assert a["local_loss/rank0"] == pytest.approx(a["loss"], rel=1e-6)
        assert a["device_norm/rank0"] == pytest.approx(a["grad_norm"], rel=1e-6)
        # Two ranks: shares add up to the loss; shards' squared norms to the squared global norm.
        assert b["device_loss/rank0"] + b["device_loss/rank1"] == pytest.approx(b["loss"], rel=1e-6)
        squares = b["device_norm/rank0"] ** 2 + b["device_norm/rank1"] ** 2
        assert math.sqrt(squares) == pytest.approx(b["grad_norm"], rel=1e-5)
        assert b["local_loss/rank0"] != b["local_loss/rank1"]  # each rank's own rows


def test_local_norms_of_a_pipeline_run_equal_one_process(tiny_config: Path, tmp_path: Path) -> None:
    """pp2: each stage holds some parameters; the names are gathered once and every norm is there."""
    common = [
        "--training.steps=2",
        "--checkpoint.enable_save=false",
        "--monitor.train_state.local_norm=true",
    ]
    one, pp2 = tmp_path / "one", tmp_path / "pp2"
    train_here(tiny_config, [*common, f"--training.output_dir={one}"])
    pp2_run = [*common, "--parallelism.pipeline_parallel=2", f"--training.output_dir={pp2}"]
    run_workers(train_runs, 2, [(str(tiny_config), pp2_run)], timeout=300)
    for a, b in zip(read_metrics(one), read_metrics(pp2), strict=True):
        keys = sorted(k for k in a if k.startswith("local_norm/"))
        assert len(keys) == 24 and keys == sorted(k for k in b if k.startswith("local_norm/"))
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
