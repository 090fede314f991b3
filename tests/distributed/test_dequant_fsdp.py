"""Quantised folders (DeepSeek-V3 block-wise FP8 with its MTP block; gpt-oss MXFP4 experts) load
sharded over dp2: each rank keeps its FSDP shard of every dequantised tensor, and the gathered
model equals the one-process load bitwise (one spawn of 2 gloo ranks for both formats)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._spawn import run_workers
from tests.unit.test_dequant import (
    DEEPSEEK,
    GPT_OSS,
    build,
    unquantised_folder,
    write_fp8_folder,
    write_mxfp4_folder,
)

pytestmark = pytest.mark.slow

CASES = (("deepseek_v3", DEEPSEEK, "fp8"), ("gpt_oss", GPT_OSS, "mxfp4"))


def _worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for name, options, fmt in CASES:
        family = resolve_family(name, None, None)
        model = family.build(options, device="meta")
        apply_fsdp(model, mesh, param_dtype=None, reduce_dtype=torch.float32)
        materialize_and_init(model, device=torch.device("cpu"), seed=0, init_fn=lambda *_: None)
        load_hf_weights(model, family, Path(root) / f"{name}_{fmt}")
        want = torch.load(Path(root) / f"{name}_{fmt}.pt")
        sharded = 0
        for pname, param in model.named_parameters():
            assert isinstance(param, DTensor), pname
            local = param.to_local()
            sharded += int(local.numel() < param.numel())
            assert torch.equal(param.full_tensor(), want[pname]), (name, pname)
        assert sharded > 10, (name, sharded)


def test_quantised_folders_load_sharded_over_dp2(tmp_path: Path) -> None:
    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.models.registry import resolve_family

    for name, options, fmt in CASES:
        unquantised_folder(name, options, tmp_path / f"{name}_plain")
        write = write_fp8_folder if fmt == "fp8" else write_mxfp4_folder
        args = (tmp_path / f"{name}_plain", tmp_path / f"{name}_{fmt}") + (
            ((128, 128),) if fmt == "fp8" else ()
        )
        write(*args)
        one = build(name, options, seed=3)
        load_hf_weights(one, resolve_family(name, None, None), tmp_path / f"{name}_{fmt}")
        torch.save({n: p.detach() for n, p in one.named_parameters()}, tmp_path / f"{name}_{fmt}.pt")
    run_workers(_worker, 2, str(tmp_path))
