"""Parallel degrees: validate them against the world size and build the DeviceMesh.

One object owns the arithmetic `world = pp * dp_replicate * dp_shard * cp * tp` so that no other
code does rank arithmetic: it asks for a mesh by purpose (`batch` for data loading, `loss` for
token-count reductions, `fsdp` for parameter sharding). Validation is pure Python so that
`meshforge config validate --world-size 1024` runs on a laptop without torch; only
`build_mesh` imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees of one run.

    Attributes:
        world_size: number of processes.
        dp_replicate: data-parallel replicas (HSDP outer axis; 1 for pure FSDP).
        dp_shard: data-parallel ranks that shard parameters (FSDP inner axis).
        cp: context-parallel degree. tp: tensor-parallel degree. pp: pipeline stages.
        ep: expert-parallel degree, carved out of `dp_shard * cp` (torchtitan's scheme).
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> ParallelDims:
        """Derive the degrees from the `parallelism` section for `world_size` processes.

        Raises:
            ValueError: naming the degrees when they cannot tile the world size.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        tp = int(parallelism.tensor_parallel)
        cp = int(parallelism.context_parallel)
        pp = int(parallelism.pipeline_parallel)
        ep = int(parallelism.expert_parallel)
        for name, value in (
            ("tensor_parallel", tp),
            ("context_parallel", cp),
            ("pipeline_parallel", pp),
            ("expert_parallel", ep),
        ):
            if value < 1:
                raise ValueError(f"parallelism.{name}: must be >= 1, got {value}")
        non_data = tp * cp * pp
        if world_size % non_data:
            raise ValueError(
                f"parallelism: world size {world_size} is not divisible by tensor_parallel ({tp}) "
                f"* context_parallel ({cp}) * pipeline_parallel ({pp}) = {non_data}"
            )
        dp = world_size // non_data
        shard = int(parallelism.data_parallel_shard)
        if shard == -1:
            dp_shard, dp_replicate = dp, 1
        elif shard >= 1:
            if dp % shard:
                raise ValueError(
                    f"parallelism.data_parallel_shard: {shard} does not divide the {dp} data-parallel "
                    f"ranks (world {world_size} / (tp {tp} * cp {cp} * pp {pp})); use -1 for all of them"
                )
            dp_shard, dp_replicate = shard, dp // shard
        else:
            raise ValueError(
                f"parallelism.data_parallel_shard: must be -1 (all data-parallel ranks) or a positive "
                f"divisor of the data-parallel ranks, got {shard}"
            )
        if (dp_shard * cp) % ep:
            raise ValueError(
                f"parallelism.expert_parallel: {ep} must divide data_parallel_shard * context_parallel "
                f"= {dp_shard} * {cp} = {dp_shard * cp} (experts are sharded over those ranks)"
            )
        return cls(world_size, dp_replicate, dp_shard, cp, tp, pp, ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def describe(self) -> str:
        """One line for logs: the degrees that are not 1."""
        parts = [f"world={self.world_size}"]
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
            value = getattr(self, name)
            if value > 1 or name == "dp_shard":
                parts.append(f"{name}={value}")
        return " ".join(parts)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh with named axes and the flattened views `batch`, `loss`, `fsdp`.

        Only data-parallel axes exist until the other dimensions are built; the caller has already
        refused other degrees with a "not supported yet" error.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if (self.cp, self.tp, self.pp, self.ep) != (1, 1, 1, 1):
            raise NotImplementedError("not supported yet: parallel degrees other than data parallel")
        if self.hsdp:
            mesh = init_device_mesh(
                device_type,
                (self.dp_replicate, self.dp_shard),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
            mesh["dp_replicate", "dp_shard"]._flatten("batch")
        else:
            mesh = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return mesh

    def mesh_for(self, mesh: DeviceMesh, purpose: str) -> DeviceMesh:
        """The mesh view for a purpose: `batch`/`loss` (all data ranks) or `fsdp` (sharding axes)."""
        if purpose in ("batch", "loss"):
            return mesh["batch"] if self.hsdp else mesh["dp_shard"]
        if purpose == "fsdp":
            return mesh["dp_replicate", "dp_shard"] if self.hsdp else mesh["dp_shard"]
        raise KeyError(f"unknown mesh purpose {purpose!r}; known: batch, loss, fsdp")
