"""Expert parallelism on the generic path: a tiny transformers Mixtral, ep2 and dp2 equal one process.

The folder is written by transformers' `save_pretrained` (per-expert checkpoint keys) and loads
through its conversion mapping into the fused `MixtralExperts`; with `expert_parallel: 2` each rank
holds 2 of the 4 experts and tokens travel by all-to-all. The losses and gradient norms of 3
steps equal one process's (global batch 2 in every layout), and the ep2 export reloads in
transformers with the one-process export's weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._compare import rel_error
from tests.conftest import read_metrics, write_corpus
from tests.distributed._spawn import run_workers
from tests.unit.test_generic_hf import TRAIN_YAML
from tests.unit.test_generic_moe import write_tiny_moe
from tests.unit.test_recompute import train_records

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

LAYOUTS = {
    "ep2": ["--parallelism.expert_parallel=2", "--training.local_batch_size=1"],
    "dp2": ["--training.local_batch_size=1"],
}


def _train_and_export(
    config: Path, overrides: list[str], out: Path
) -> tuple[list[tuple[float, float]], list[int]]:
    """``(loss, grad_norm)`` of 3 steps of ``meshforge train`` in this process, with the HF export,
    and the number of experts each expert-parallel module holds on this rank."""
    from torch.distributed.tensor import DTensor

    from meshforge.config import load_config
    from meshforge.parallel.expert import is_expert_parallel
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(config),
        [
            "--training.steps=3",
            "--training.deterministic=true",
            "--checkpoint.enable_save=false",
            "--checkpoint.save_hf_weights=true",
            f"--training.output_dir={out}",
            *overrides,
        ],
    )
    trainer = Trainer(cfg, log=lambda _line: None)
    trainer.setup()
    local = []
    for module in trainer.model.modules():
        if is_expert_parallel(module):
            weight = module.gate_up_proj
            local.append((weight.to_local() if isinstance(weight, DTensor) else weight).shape[0])
    try:
        trainer.train()
    finally:
        trainer.close()
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)], local


def _worker(rank: int, world: int, root: str, want: list[tuple[float, float]]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    folder = Path(root)
    errors: list[str] = []
    for name, layout in LAYOUTS.items():
        if name == "ep2":
            got, local = _train_and_export(folder / "generic.yaml", layout, folder / name)
            if local != [2, 2]:
                errors.append(
                    f"ep2: experts held per expert-parallel module {local}, want 2 of 4 in each layer"
                )
        else:
            got = train_records(folder / "generic.yaml", layout, folder / name, steps=3)
        for step, ((loss, norm), (loss1, norm1)) in enumerate(zip(got, want, strict=True), start=1):
            if abs(loss - loss1) > 1e-5 * abs(loss1) or abs(norm - norm1) > 1e-5 * abs(norm1):
                errors.append(
                    f"{name} step {step}: (loss, grad_norm) {(loss, norm)} != one process {(loss1, norm1)}"
                )
    assert not errors, "\n".join(errors)


def test_generic_mixtral_ep2_and_dp2_equal_one_process(tmp_path: Path) -> None:
    hf = write_tiny_moe(tmp_path / "hf", "mixtral")
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=40)
    config = tmp_path / "generic.yaml"
    config.write_text(TRAIN_YAML.format(data=corpus, model=hf, extra=""))
    want, _ = _train_and_export(config, [], tmp_path / "one")
    run_workers(_worker, 2, str(tmp_path), want)
    one = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf", dtype=torch.float32)
    ep2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ep2" / "hf", dtype=torch.float32)
    theirs = ep2.state_dict()
    for key, tensor in one.state_dict().items():
        assert rel_error(theirs[key], tensor) <= 1e-5, key
