"""Compiled decoder layers under two-rank context parallelism: one graph each, eager numbers (gloo).

The one-rank cases of ``tests/unit/test_graph_breaks.py`` trace the CP code path with trivial
exchanges; here the all-to-alls (ulysses, on qwen3) and the all-gather (kvallgather, on qwen3_moe) really
move halves of packed rows between two ranks. Each layer kind is traced by
``torch._dynamo.explain`` (no break), then compiled through AOTAutograd (``aot_eager``: the
functional collectives and their backward in the traced graphs, without inductor's compile
time) and compared with the eager layer: output, input gradient and parameter gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests._compare import rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

TOL = 1e-6


def _check(family: str, method: str, mesh) -> None:
    import torch._dynamo as dynamo

    from meshforge.parallel.context import apply_cp, shard_batch_for_cp
    from tests.unit.test_graph_breaks import (
        SPEC_BY_NAME,
        _build,
        _detached,
        assert_one_graph,
        layer_calls,
        packed_batch,
    )

    model = _build(SPEC_BY_NAME[family])
    apply_cp(model, mesh, method=method)
    batch = shard_batch_for_cp(packed_batch(model), mesh, method=method)
    for layer, args, kwargs in layer_calls(model, batch):
        what = f"{family} {method} {type(layer).__name__}"
        assert_one_graph(layer, args, kwargs)
        results = []
        for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
            layer.zero_grad(set_to_none=True)
            inputs = _detached(args, requires_grad=True)
            out = run(*inputs, **kwargs)
            out.square().sum().backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            results.append((out.detach(), inputs[0].grad.clone(), grads))
        (eager, eager_dx, eager_grads), (compiled, compiled_dx, compiled_grads) = results
        assert rel_error(compiled, eager) <= TOL, (what, rel_error(compiled, eager))
        assert rel_error(compiled_dx, eager_dx) <= TOL, (what, rel_error(compiled_dx, eager_dx))
        assert eager_grads.keys() == compiled_grads.keys() and len(eager_grads) > 4, what
        for name, grad in eager_grads.items():
            assert rel_error(compiled_grads[name], grad) <= TOL, (what, name)
        dynamo.reset()


def _worker(rank: int, world: int) -> None:
    import torch._dynamo as dynamo
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    # The MoE expert loop's group sizes (see tests/unit/test_graph_breaks.py).
    with dynamo.config.patch(capture_scalar_outputs=True):
        # One method per family keeps the launch short; the one-rank unit cases cover every pair.
        _check("qwen3", "ulysses", mesh)
        _check("qwen3_moe", "kvallgather", mesh)


def test_compiled_cp_layers_two_ranks_one_graph_eager_numbers() -> None:
    run_workers(_worker, 2)
