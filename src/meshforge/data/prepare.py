"""Which ranks prepare shared data, and the others wait for it: once per job or once per node.

Preparing data (tokenising SFT datasets, building Megatron index caches, converting raw files)
writes caches that the other ranks then read. Where the caches live decides who must write
them: on a file system every node shares, one rank of the job writes and every rank reads; on
node-local disks, one rank per node writes its node's copy. The preparer runs first, the others
wait at a barrier and then find the cache (the `datasets` cache or `tokenized_path` for SFT data,
the `.npy` index caches for Megatron data) instead of doing the work again.

The rank within the node comes from torchrun's `LOCAL_RANK`; without it every rank counts as
its own node's first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def _ranks() -> tuple[int, int, bool]:
    """(global rank, rank within the node, whether a process group runs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 0, False
    rank = dist.get_rank()
    return rank, int(os.environ.get("LOCAL_RANK", rank)), True


def preparer_rank(*, per_node: bool) -> int:
    """0 on the ranks that prepare: the job's rank 0, or with `per_node` each node's first rank."""
    rank, local_rank, _ = _ranks()
    return local_rank if per_node else rank


@contextlib.contextmanager
def preparers_first(*, per_node: bool) -> Iterator[bool]:
    """Run the body on the preparing ranks first, then on the others; yields "this rank prepares".

    Every rank of the default group must enter (the barrier between the two turns is collective).
    """
    import torch.distributed as dist

    _, _, distributed = _ranks()
    preparer = preparer_rank(per_node=per_node) == 0
    if distributed and not preparer:
        dist.barrier()
    try:
        yield preparer
    finally:
        if distributed and preparer:
            dist.barrier()
