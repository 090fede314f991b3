"""bf16 training on 2 FSDP2 ranks: `accumulate_allreduce_grads_in_fp32` picks the reduce dtype of
`MixedPrecisionPolicy` and the accumulation dtype, and the losses stay close to fp32's."""

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
    runs = {name: run(config, out, name, steps=2) for name in ("fp32", "m_fp32acc", "m_bf16acc")}
    ref = runs["fp32"]
    # Reduce-scatter dtype: fp32 by default, bf16 with the flag off (fp32 parameters, bf16 compute).
    assert ref["reduce_dtypes"] == ["torch.float32"]
    assert runs["m_fp32acc"]["reduce_dtypes"] == ["torch.float32"]
    assert runs["m_bf16acc"]["reduce_dtypes"] == ["torch.bfloat16"]
    assert grad_dtypes(runs["m_fp32acc"]) == {torch.float32}
    # Same tolerance as one process (tests/unit/test_grad_accum_dtype.py): 2e-3 relative.
    for name, r in runs.items():
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3), name
    close, far = grad_error(runs["m_fp32acc"], ref), grad_error(runs["m_bf16acc"], ref)
    assert close < far < 5e-2, (close, far)


def test_bf16_dp2_reduce_and_accumulation_dtypes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.format(data=corpus))
    run_workers(_worker, 2, str(tmp_path))
