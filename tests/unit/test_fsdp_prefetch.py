"""`parallelism.hook_modules` and the prefetch depths set the FSDP units' explicit prefetch lists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshforge.models.qwen3.args import Qwen3Args
from meshforge.models.qwen3.model import build_qwen3
from meshforge.parallel.fsdp import apply_fsdp, apply_fsdp_patterns


@pytest.fixture
def mesh():
    # Another in-process test may have left a 1-rank default group behind: use it then.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard_cp",))
    finally:
        if owned:
            dist.destroy_process_group()


def _model():
    args = Qwen3Args(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return build_qwen3(args)


def _forward_targets(module) -> list:
    return list(module._get_fsdp_state()._states_to_forward_prefetch)


def _state(module):
    return module._get_fsdp_state()


def test_hook_modules_choose_the_prefetch_chain(mesh) -> None:
    model = _model()
    fsdp = dict(param_dtype=None, reduce_dtype=torch.float32)
    apply_fsdp(model, mesh, hook_modules=["model.layers.0", "model.layers.{2-3}"], **fsdp)
    layers = model.model.layers
    assert _forward_targets(layers[0]) == [_state(layers[2])]
    assert _forward_targets(layers[2]) == [_state(layers[3])]
    assert _forward_targets(layers[1]) == []  # not in the chain: FSDP's implicit order only


def test_prefetch_depths_on_the_pattern_path(mesh) -> None:
    model = _model()
    units = ["model.layers.{*}.self_attn", "model.layers.{*}.mlp"]
    apply_fsdp_patterns(
        model, mesh, fsdp_modules=units, param_dtype=None, reduce_dtype=torch.float32, forward_prefetch=2
    )
    first = model.model.layers[0]
    assert _forward_targets(first.self_attn) == [_state(first.mlp), _state(model.model.layers[1].self_attn)]


def test_a_hook_module_must_be_an_fsdp_unit(mesh) -> None:
    with pytest.raises(ValueError, match=r"parallelism.hook_modules: model.norm is not an FSDP unit"):
        apply_fsdp(_model(), mesh, param_dtype=None, reduce_dtype=torch.float32, hook_modules=["model.norm"])
