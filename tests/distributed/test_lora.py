"""LoRA in 2-rank layouts equals one process: FSDP dp2, tp2 (SP), pp2 and cp2, three steps each.

One spawn of 2 gloo processes trains the same adapters on the same HF base (tiny qwen3 folder)
under each layout; the per-step losses and gradient norms must match the single-process run
made here first (norm-relative 1e-5: the reductions add in another order). Under tp2 the
adapters must be sharded like their base (A whole and B split for colwise q/v, A split and B
whole for rowwise down_proj), so the base output needs no collective of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import write_corpus
from tests.distributed._spawn import run_workers
from tests.unit.test_recompute import train_records

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp2": ["--training.local_batch_size=1"],
    "tp2": ["--parallelism.tensor_parallel=2"],
    "pp2": ["--parallelism.pipeline_parallel=2", "--training.local_batch_size=1"],
    "cp2": ["--parallelism.context_parallel=2", "--parallelism.context_parallel_method=ulysses"],
}


def _close(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> bool:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return bool(((a - b).norm() / b.norm()).item() <= 1e-5)


def _tp_placements(config: Path, out: Path) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(config), [*LAYOUTS["tp2"], "--checkpoint.enable_save=false", f"--training.output_dir={out}"]
    )
    trainer = Trainer(cfg, log=lambda _line: None)
    trainer.setup()
    try:
        found = {}
        for name, param in trainer.model.named_parameters():
            if "layers.0." in name and ("lora_" in name or name.endswith("proj.weight")):
                assert isinstance(param, DTensor), name
                found[name.removeprefix("model.layers.0.")] = str(param.placements)
        return found
    finally:
        trainer.close()


def _worker(rank: int, world: int, root: str, want: list[tuple[float, float]]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    folder = Path(root)
    failures = []
    for layout, overrides in LAYOUTS.items():
        got = train_records(folder / "lora.yaml", overrides, folder / layout, steps=3)
        if not _close(got, want):
            failures.append(f"{layout}: {got} != {want}")
    placements = _tp_placements(folder / "lora.yaml", folder / "tp2_placements")
    for name, expected in (
        ("self_attn.q_proj.weight", "(Shard(dim=0),)"),
        ("self_attn.q_proj.lora_A.weight", "(Replicate(),)"),
        ("self_attn.q_proj.lora_B.weight", "(Shard(dim=0),)"),
        ("mlp.down_proj.weight", "(Shard(dim=1),)"),
        ("mlp.down_proj.lora_A.weight", "(Shard(dim=1),)"),
        ("mlp.down_proj.lora_B.weight", "(Replicate(),)"),
    ):
        if placements.get(name) != expected:
            failures.append(f"tp2 {name}: {placements.get(name)} (want {expected})")
    assert not failures, "\n".join(failures)


def test_lora_layouts_equal_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_hf_interop import _save_hf_model
    from tests.unit.test_lora_train import YAML

    hf = _save_hf_model(tmp_path / "hf", tied=False, shard=None, seed=4)
    config = tmp_path / "lora.yaml"
    config.write_text(YAML.format(data=write_corpus(tmp_path / "corpus.jsonl", num_docs=40), hf=hf))
    want = train_records(config, [], tmp_path / "one", steps=3)
    run_workers(_worker, 2, str(tmp_path), want)
