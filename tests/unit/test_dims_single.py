"""One process builds one process group (a dozen 1-rank gloo groups aborted ~1 in 5 runs at exit),
and a second run in the same process reuses the mesh until the default group is replaced."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from types import SimpleNamespace as NS
from meshforge.parallel.dims import ParallelDims
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = len(c10d._world.pg_map)
par = NS(
    tensor_parallel=1, context_parallel=1, pipeline_parallel=1, expert_parallel=1, data_parallel_shard=-1,
    ep_fsdp_size=None, dense_fsdp_shard_size=None,
)
dims = ParallelDims.from_config(par, 1)
mesh = dims.build_mesh("cpu")
views = {p: mesh.view(p) for p in dims.PURPOSES}
assert all(v.size() == 1 and v.get_local_rank() == 0 for v in views.values())
print(len(c10d._world.pg_map) - before)
groups = len(c10d._world.pg_map)
assert dims.build_mesh("cpu") is mesh
assert ParallelDims.from_config(par, 1).build_mesh("cpu") is mesh
assert len(c10d._world.pg_map) == groups
dist.destroy_process_group()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
again = dims.build_mesh("cpu")
assert again is not mesh and again.view("fsdp").size() == 1
dist.destroy_process_group()
print("reuse ok")
"""


@pytest.mark.procs
def test_single_process_mesh_creates_one_group() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert int(lines[-2]) <= 1
    assert lines[-1] == "reuse ok"
