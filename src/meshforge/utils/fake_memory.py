"""DTensor's sharding propagation kept out of a fake-tensor memory tracker's count.

Why: to learn an op's output shape, DTensor runs the op once on fake tensors of the *global*
shapes of its DTensor arguments (`ShardingPropagator._propagate_tensor_meta_non_cached`), under
the active fake mode when there is one. A memory tracker on the dispatch-mode stack (torch's
`MemTracker`, as the dry run uses) sees those as allocations of the current step: a fused AdamW
update over FSDP-sharded parameters then "holds" 16 bytes per global parameter (1 TiB for a 70B
model, on any number of ranks), and a first matmul of a TP-sharded weight holds its whole weight.
A real run allocates none of them (no fake mode is active there: the propagator makes its own).

`sharding_propagation_untracked()` runs that propagation outside every active dispatch mode for
the block, as a real run does: the propagator then makes its own fake mode, shapes come out the
same, and the tracker counts what the step itself allocates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def sharding_propagation_untracked() -> Iterator[None]:
    """Within the block, DTensor's output-shape propagation runs with no dispatch mode active."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original: Callable[..., Any] = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: ShardingPropagator, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]
