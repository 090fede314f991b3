"""Sharded random init gives exactly the weights one process gets (DESIGN.md platform facts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

OPTIONS = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}


def _build(device: torch.device, shard: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply_fsdp

    family = resolve_family("qwen3", None, None)
    model = family.build(OPTIONS)
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, mesh, param_dtype=None, reduce_dtype=torch.float32)
    materialize_and_init(model, device=device, seed=123, init_fn=model.init_full_parameter_)
    return model


def _worker(rank: int, world: int, out_path: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = _build(torch.device("cpu"), shard=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out_path)


def test_two_rank_init_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "sharded.pt"
    run_workers(_worker, 2, str(out))
    sharded = torch.load(out)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        single = _build(torch.device("cpu"), shard=False).state_dict()
    finally:
        dist.destroy_process_group()
    assert set(sharded) == set(single)
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name
    # Different parameters really got different draws.
    assert not torch.equal(
        single["model.layers.0.mlp.up_proj.weight"][:8], single["model.layers.1.mlp.up_proj.weight"][:8]
    )
