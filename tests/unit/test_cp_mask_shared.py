"""Every layer of one forward shares the forward's `CPMask`, and so its ring plan and masks.

FSDP2 casts each unit's forward inputs with a tree map that rebuilds dataclasses field by field:
with `CPMask` a dataclass each layer got its own copy of the mask's cache and built (and kept,
through the forward) its own ring plan, two `[S/2, S/2]` boolean masks a layer under the
load-balanced ring (15.5 GiB at 64k tokens, CP 2, Llama-3.1-8B: benchmarks/README.md). One
rank of a CP 2 x FSDP layout runs here on fake tensors (`train/dry_run.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.utils import _apply_to_tensors

from meshforge.config.loader import load_config
from meshforge.parallel.context import CPMask
from meshforge.parallel.context.plan import ContextParallel
from meshforge.train.dry_run import dry_run

LLAMA = Path(__file__).resolve().parents[2] / "configs/llama/tiny.yaml"


def test_a_tree_map_over_layer_inputs_keeps_the_mask_itself() -> None:
    mask = CPMask(q_index=torch.arange(4), seq_len=8, segments=None)
    mapped = _apply_to_tensors(lambda t: t.clone(), ((torch.ones(2), mask), {"mask": mask}))
    assert mapped[0][1] is mask and mapped[1]["mask"] is mask


def test_one_ring_plan_per_forward_under_fsdp_and_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    plan = ContextParallel._ring_plan

    def counting(self: ContextParallel, q_index, kv_index_of, mask, window, tag):  # type: ignore[no-untyped-def]
        if (tag, window, "plan") not in mask.cache:
            built.append(id(mask))
        return plan(self, q_index, kv_index_of, mask, window, tag)

    monkeypatch.setattr(ContextParallel, "_ring_plan", counting)
    layers = 4
    cfg = load_config(
        LLAMA,
        [
            f"--model.num_hidden_layers={layers}",
            "--training.local_batch_size=1",
            "--train_dataset.dataloader.seq_length=64",
            "--parallelism.context_parallel=2",
            "--parallelism.context_parallel_method=colossal",
            "--model.compute_dtype=bfloat16",  # FSDP's mixed precision casts the layers' inputs
            "--recompute.mode=full",
            f"--recompute.full_recompute_layer=[0-{layers - 1}]",
        ],
    )
    dry_run(cfg, world_size=4)
    # One build per micro-batch's forward (the recomputation in backward reuses it), not per layer.
    assert 0 < len(built) <= 2, built
