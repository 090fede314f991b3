"""Parallel degrees: validate them against the world size and build the DeviceMesh.

One object owns the arithmetic `world = pp * dp_replicate * dp_shard * cp * tp` so that no other
code does rank arithmetic: it asks for a mesh by purpose (`batch` for data loading, `loss` for
token-count reductions, `fsdp` for parameter sharding). Validation is pure Python so that
`meshforge config validate --world-size 1024` runs on a laptop without torch; only
`build_mesh` imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.parallel.config import ParallelismConfig


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees of one run.

    Attributes:
        world_size: number of processes.
        dp_replicate: data-parallel replicas (HSDP outer axis; 1 for pure FSDP).
        dp_shard: data-parallel ranks that shard parameters (FSDP inner axis).
        cp: context-parallel degree. tp: tensor-parallel degree. pp: pipeline stages.
        ep: expert-parallel degree, carved out of `dp_shard * cp` (torchtitan's scheme).
        ep_fsdp: how many of the data-shard ranks outside an expert-parallel group shard each
            expert's weights (MindSpeed `ep_fsdp_size`); the others hold replicas. 0 = all of
            them (`dp_shard_mod_ep`, the default).
        dense_shard: how many ranks shard each dense (non-expert) parameter (MindFormers
            `dense_fsdp_shard_size`); the other data and context ranks hold replicas. 0 = all of
            `dp_shard * cp` (the default).
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    ep_fsdp: int = 0
    dense_shard: int = 0

    @classmethod
    def from_config(cls, parallelism: ParallelismConfig, world_size: int) -> ParallelDims:
        """Derive the degrees from the `parallelism` section for `world_size` processes.

        Raises:
            ValueError: naming the degrees when they cannot tile the world size.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        tp = parallelism.tensor_parallel
        cp = parallelism.context_parallel
        pp = parallelism.pipeline_parallel
        ep = parallelism.expert_parallel
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
        shard = parallelism.data_parallel_shard
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
        if ep > 1:
            if (dp_shard * cp) % ep:
                raise ValueError(
                    f"parallelism.expert_parallel: {ep} must divide data_parallel_shard * context_parallel "
                    f"= {dp_shard} * {cp} = {dp_shard * cp} (experts are sharded over those ranks)"
                )
            if ep % cp:
                raise ValueError(
                    f"parallelism.expert_parallel: {ep} must be a multiple of context_parallel ({cp}): an "
                    "expert-parallel group spans whole context-parallel groups"
                )
        ep_fsdp = parallelism.ep_fsdp_size or 0
        if ep == 1 and ep_fsdp == 1:
            ep_fsdp = 0  # MindSpeed's default: no expert parallelism, nothing to say
        if ep_fsdp:
            outside = dp_shard * cp // ep if ep > 1 else dp_shard
            if ep == 1:
                raise ValueError(
                    f"parallelism.ep_fsdp_size: {ep_fsdp} shards expert weights inside expert parallelism; "
                    "set parallelism.expert_parallel > 1 (or leave ep_fsdp_size unset)"
                )
            if outside % ep_fsdp:
                raise ValueError(
                    f"parallelism.ep_fsdp_size: {ep_fsdp} must divide the {outside} data-shard ranks outside "
                    f"an expert-parallel group (data_parallel_shard {dp_shard} * context_parallel {cp} / "
                    f"expert_parallel {ep})"
                )
            if ep_fsdp == outside:
                ep_fsdp = 0
        dense = parallelism.dense_fsdp_shard_size or 0
        if dense:
            if (dp_shard * cp) % dense:
                raise ValueError(
                    f"parallelism.dense_fsdp_shard_size: {dense} must divide the {dp_shard * cp} ranks that "
                    f"shard dense weights (data_parallel_shard {dp_shard} * context_parallel {cp})"
                )
            if dense == dp_shard * cp:
                dense = 0
        return cls(world_size, dp_replicate, dp_shard, cp, tp, pp, ep, ep_fsdp, dense)

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

    @property
    def dp_shard_in_ep(self) -> int:
        """Data-shard ranks inside one expert-parallel group (ep = dp_shard_in_ep * cp)."""
        return max(self.ep // self.cp, 1) if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """Data-shard ranks across expert-parallel groups: they shard expert weights FSDP-style."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def expert_shard(self) -> int:
        """Ranks that shard each expert's weights (the efsdp mesh's shard axis)."""
        return self.ep_fsdp or self.dp_shard_mod_ep

    @property
    def expert_replicas(self) -> int:
        """Replicas of each expert shard (the efsdp mesh's replicate axis; 1 = plain FSDP)."""
        return self.dp_replicate * self.dp_shard_mod_ep // self.expert_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard (and sum the gradients of) dense parameters: dp_shard * cp."""
        return self.dp_shard * self.cp

    @property
    def dense_shard_size(self) -> int:
        """Ranks that shard each dense parameter (the fsdp mesh's shard axis)."""
        return self.dense_shard or self.fsdp_size

    @property
    def dense_replicas(self) -> int:
        """Replicas of each dense shard: the HSDP replicas and the groups of dense_fsdp_shard_size."""
        return self.dp_replicate * self.fsdp_size // self.dense_shard_size

    @property
    def needs_fsdp(self) -> bool:
        """FSDP reduces gradients over replicas, data shards and context-parallel ranks."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")

    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of `MESH_DIMS`, outermost first (tp innermost: its ranks are neighbours)."""
        return (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.dp_shard_in_ep, self.cp, self.tp)

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The DeviceMesh with every named axis (size 1 allowed) and one view per purpose.

        A process that builds several runs (a sweep in a notebook, a test process) gets the
        mesh of an earlier run with the same degrees back instead of a new one: each mesh makes
        about a dozen process groups, each with its own gloo threads and sockets, which live
        until the default group is destroyed (DTensor caches its plans by mesh equality, so an
        equal mesh must not be torn down while the process runs). The reuse ends with the
        default group: a new default group gets new meshes.
        """
        import torch.distributed as dist

        key = (self, device_type)
        built = _BUILT_MESHES.get(key)
        if built is not None and dist.is_initialized() and built[0] is dist.group.WORLD:
            return built[1]
        mesh = self._new_mesh(device_type)  # initialises the default group when there is none
        world = dist.group.WORLD
        for stale in [k for k, (group, _) in _BUILT_MESHES.items() if group is not world]:
            del _BUILT_MESHES[stale]
        _BUILT_MESHES[key] = (world, mesh)
        return mesh

    def _new_mesh(self, device_type: str) -> ParallelMesh:
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_size == 1:
            # One process: one 1-rank mesh serves every purpose. The full 6-axis mesh with its
            # flattened views makes a dozen gloo groups in a HashStore world of one, and tearing
            # those down at exit aborted about one single-process run in five ("terminate called
            # without an active exception"); a single group does not.
            single = init_device_mesh(device_type, (1,), mesh_dim_names=("world",))
            return ParallelMesh(single, dict.fromkeys(self.PURPOSES, single))
        root = init_device_mesh(device_type, self.mesh_shape(), mesh_dim_names=self.MESH_DIMS)
        views: dict[str, DeviceMesh] = {name: root[name] for name in ("pp", "cp", "tp")}
        views["batch"] = root["dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("batch")
        loss = root["dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("loss")
        views["loss"] = loss
        views["ep"] = root["dp_shard_in_ep", "cp"]._flatten("ep")
        if self.dense_replicas > 1:
            # 2-D replicate x shard meshes for HSDP (and dense_fsdp_shard_size), made by
            # unflattening (slicing a flattened dim out of the root mesh is deprecated).
            names = ("fsdp_replicate", "fsdp_shard") if self.dense_shard else ("dp_replicate", "dp_shard_cp")
            views["fsdp"] = loss._unflatten(0, (self.dense_replicas, self.dense_shard_size), names)
        else:
            views["fsdp"] = root["dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("dp_shard_cp")
        if self.expert_replicas > 1:
            # Experts HSDP-style: shard over `expert_shard` neighbouring ranks, replicate across
            # the data replicas and the other shard groups (ep_fsdp_size, HSDP).
            rep_mod = root["dp_replicate", "dp_shard_mod_ep"]._flatten("dp_replicate_mod_ep")
            views["efsdp"] = rep_mod._unflatten(
                0, (self.expert_replicas, self.expert_shard), ("efsdp_replicate", "efsdp_shard")
            )
        else:
            views["efsdp"] = root["dp_shard_mod_ep"]
        return ParallelMesh(root, views)

    PURPOSES = ("batch", "loss", "fsdp", "efsdp", "tp", "cp", "pp", "ep")

    def mesh_for(self, mesh: ParallelMesh, purpose: str) -> DeviceMesh:
        """The mesh view for a purpose.

        `batch`: data ranks (which rows a rank loads); `loss`: data ranks x cp (token-count and
        loss reductions); `fsdp`: dense parameters' sharding (2-D replicate x shard under HSDP);
        `efsdp`: expert parameters' sharding outside the ep group; `tp`, `cp`, `pp`, `ep`.
        """
        return mesh.view(purpose)


@dataclass(frozen=True)
class ParallelMesh:
    """The root DeviceMesh and its views by purpose (see `ParallelDims.mesh_for`)."""

    root: DeviceMesh
    views: dict[str, DeviceMesh]

    def view(self, purpose: str) -> DeviceMesh:
        try:
            return self.views[purpose]
        except KeyError:
            raise KeyError(f"unknown mesh purpose {purpose!r}; known: {', '.join(self.views)}") from None


# The meshes this process built, by degrees and device type, with the default group they were
# built in (see `ParallelDims.build_mesh`).
_BUILT_MESHES: dict[tuple[ParallelDims, str], tuple[object, ParallelMesh]] = {}
