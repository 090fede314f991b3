"""bf16 training on 2 FSDP2 ranks: `accumulate_allreduce_grads_in_fp32` picks the reduce dtype of
`MixedPrecisionPolicy` and the accumulation dtype, and the losses stay close to fp32's; float8
and MXFP8 linear layers (emulated) compose with FSDP2 and stay close to the bf16 run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_CONFIG, write_corpus
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, root: str) -> None:
    from tests._bf16_runs import grad_dtypes, grad_error, run

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    config, out = Path(root) / "tiny.yaml", Path(root) / f"rank{rank}"
    # The accumulation-dtype ordering (fp32 closer than bf16) is checked in one process
    # (tests/unit/test_grad_accum_dtype.py); here each layout's dtypes and losses.
    names = ("fp32", "m_bf16acc", "mxfp8")
    runs = {name: run(config, out, name, steps=2, global_batch=4) for name in names}
    ref = runs["fp32"]
    # Reduce-scatter dtype: fp32 by default, bf16 with the flag off (fp32 parameters, bf16 compute).
    assert ref["reduce_dtypes"] == ["torch.float32"]
    assert runs["m_bf16acc"]["reduce_dtypes"] == ["torch.bfloat16"]
    assert grad_dtypes(runs["m_bf16acc"]) == {torch.float32}  # fp32 shards holding bf16 sums
    # Same tolerance as one process (tests/unit/test_grad_accum_dtype.py): 2e-3 relative.
    for name, r in runs.items():
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3), name
    assert grad_error(runs["m_bf16acc"], ref) < 5e-2
    # MXFP8 (emulated): converted before FSDP, inside the layer units; its losses are within
    # the tolerance above of the fp32 run.
    from torch.distributed.fsdp import FSDPModule

    layer = runs["mxfp8"]["model"].model.layers[0]
    assert isinstance(layer, FSDPModule) and type(layer.mlp.up_proj).__name__ == "AutocastMXFP8Linear"
    # With the flag off, every gradient the optimizer gets holds a bf16 sum.
    for name, (_, grad) in runs["m_bf16acc"]["grads"].items():
        assert torch.equal(grad.to(torch.bfloat16).double(), grad), name


def test_bf16_dp2_reduce_and_accumulation_dtypes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.format(data=corpus))
    run_workers(_worker, 2, str(tmp_path))
