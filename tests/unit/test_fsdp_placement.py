"""FSDP shard placement names and ignored-module resolution, without a process group.

`resolve_shard_placement` turns `parallelism.shard_placement_fn` into the function FSDP2 calls per
parameter; `mark_ignored` resolves `parallelism.ignored_modules`. Both must fail with messages
that name the config key; the distributed behaviour is in tests/distributed/test_fsdp_ignored.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from meshforge.optim.param_groups import split_by_tensor_kind
from meshforge.parallel.fsdp import (
    ignored_parameter_names,
    mark_ignored,
    resolve_shard_placement,
    sync_ignored_grads,
)
from meshforge.parallel.fsdp.placement import log_fallbacks as _log_fallbacks


def dim1_if_wide(param: nn.Parameter) -> Shard | None:
    """A user placement function, reached by its dotted path."""
    return Shard(1) if param.ndim == 2 and param.shape[1] > param.shape[0] else None


def returns_an_int(param: nn.Parameter) -> int:
    return 1


NOT_CALLABLE = 3


def p(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape))


def test_builtin_placements() -> None:
    dim0 = resolve_shard_placement("shard_by_dim_0", shard_size=2)
    dim1 = resolve_shard_placement("shard_by_dim_1", shard_size=2)
    largest = resolve_shard_placement("shard_largest_dim", shard_size=2)
    assert resolve_shard_placement(None, shard_size=2) is None
    assert dim0(p(4, 6)) == Shard(0)
    assert dim1(p(4, 6)) == Shard(1)
    assert dim1(p(3, 6, 8)) == Shard(1)
    assert dim1(p(5)) == Shard(0)  # a vector has only dim 0
    assert largest(p(4, 6)) == Shard(1)
    assert largest(p(8, 6)) == Shard(0)
    assert largest(p(6, 6)) == Shard(0)  # the first of equal dims
    assert largest(p(2, 4, 10)) == Shard(2)
    assert dim1.fallbacks == [] and largest.fallbacks == []
    # FSDP2 cannot split a dim > 0 unevenly: dim 0 (padded) instead, recorded for the log.
    assert dim1(p(4, 7)) == Shard(0)
    assert dim1.fallbacks == [(4, 7)]
    assert largest(p(2, 6, 7)) == Shard(1)  # 7 does not divide: the largest dim that does
    assert largest(p(3, 7)) == Shard(0)
    assert largest.fallbacks == [(2, 6, 7), (3, 7)]
    # With one shard everything divides.
    assert resolve_shard_placement("shard_by_dim_1", shard_size=1)(p(4, 7)) == Shard(1)
    assert resolve_shard_placement(" shard_by_dim_1 ", shard_size=2)(p(2, 2)) == Shard(1)


def test_fallbacks_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    dim1 = resolve_shard_placement("shard_by_dim_1", shard_size=4)
    dim1(p(4, 6))
    with caplog.at_level(logging.INFO, logger="meshforge.parallel.fsdp"):
        _log_fallbacks(dim1)
    assert "1 parameters sharded on another dim" in caplog.text and "(4, 6)" in caplog.text


@pytest.mark.parametrize(
    "spec",
    [f"{__name__}:dim1_if_wide", f"{__name__}.dim1_if_wide", "tests.unit.test_fsdp_placement:dim1_if_wide"],
)
def test_user_function_by_dotted_path(spec: str) -> None:
    fn = resolve_shard_placement(spec, shard_size=2)
    assert fn(p(2, 8)) == Shard(1)
    assert fn(p(8, 2)) is None


def test_user_function_must_return_shard_or_none() -> None:
    fn = resolve_shard_placement(f"{__name__}:returns_an_int", shard_size=2)
    with pytest.raises(TypeError, match=r"parallelism.shard_placement_fn: .*returned 1 .*shape \(2, 2\)"):
        fn(p(2, 2))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("shard_by_dim_2", r"unknown shard placement 'shard_by_dim_2' \(did you mean 'shard_by_dim_1'\?\); "),
        ("largest", r"unknown shard placement 'largest'; expected one of shard_by_dim_0, shard_by_dim_1, "),
        ("no_such_pkg_xyz.mod:fn", r"cannot import 'no_such_pkg_xyz.mod'"),
        (f"{__name__}:missing_fn", r".*has no attribute 'missing_fn'"),
        (f"{__name__}:NOT_CALLABLE", r".*is a int, not a function"),
        ("", r"expected a placement name"),
    ],
)
def test_bad_names_name_the_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^parallelism.shard_placement_fn: " + message):
        resolve_shard_placement(spec, shard_size=2)
    with pytest.raises(ValueError, match=r"^parallelism.efsdp_shard_placement_fn: "):
        resolve_shard_placement(spec, shard_size=2, key_path="parallelism.efsdp_shard_placement_fn")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, 4)
        self.model.rotary = nn.Identity()
        self.model.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(2)]
        )
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied: named once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h)


def test_mark_ignored_records_names_and_validates() -> None:
    model = Tiny()
    params = mark_ignored(model, ["model.embed_tokens", "model.layers.{1-1}.{*}"])
    assert ignored_parameter_names(model) == (
        "model.embed_tokens.weight",
        "model.layers.1.0.weight",
        "model.layers.1.0.bias",
        "model.layers.1.2.weight",
        "model.layers.1.2.bias",
    )
    assert {id(x) for x in params} == {id(model.get_parameter(n)) for n in ignored_parameter_names(model)}
    assert mark_ignored(model, None) == set() and ignored_parameter_names(model) == ()
    assert ignored_parameter_names(nn.Linear(2, 2)) == ()
    key = r"^parallelism.ignored_modules"
    with pytest.raises(ValueError, match=key + r"\[1\]: pattern 'model.layer.{\*}' matches no module; e.g. "):
        mark_ignored(model, ["lm_head", "model.layer.{*}"])
    with pytest.raises(ValueError, match=key + r"\[0\]: .*unrecognised brace"):
        mark_ignored(model, ["model.layers.{x}"])
    with pytest.raises(ValueError, match=key + r"\[1\]: pattern 'model.rotary' matches only modules without"):
        mark_ignored(model, ["lm_head", "model.rotary"])
    with pytest.raises(ValueError, match=key + r": every parameter of the model is ignored"):
        mark_ignored(model, ["model", "lm_head"])
    with pytest.raises(ValueError, match=key + r": expected a list of module patterns, got the string"):
        mark_ignored(model, "lm_head")


def test_ignored_module_runs_in_its_stored_dtype_under_mixed_precision() -> None:
    # FSDP's units compute in bf16; an ignored module keeps fp32 weights, so its inputs are
    # cast up and its outputs back down (else F.linear would refuse bf16 x fp32).
    model = Tiny()
    mark_ignored(model, ["model.layers.0"], param_dtype=torch.bfloat16)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    out = model.model.layers[0](x)
    assert out.dtype == torch.bfloat16
    expected = model.model.layers[0][2](model.model.layers[0][1](model.model.layers[0][0](x.float())))
    torch.testing.assert_close(out, expected.to(torch.bfloat16))
    # Nested matches get one pair of hooks (on the outer module).
    assert len(model.model.layers[0][0]._forward_pre_hooks) == 0


def test_sync_without_process_group_keeps_missing_grads_none() -> None:
    model = Tiny()
    mark_ignored(model, ["model.layers.{*}"])
    model.model.layers[0][0].weight.grad = torch.ones(4, 4)
    # One process: nothing to sum, the gradient is unchanged and a missing one stays None.
    assert sync_ignored_grads(model) == 1
    assert torch.equal(model.model.layers[0][0].weight.grad, torch.ones(4, 4))
    assert model.model.layers[1][0].weight.grad is None
    assert sync_ignored_grads(Tiny()) == 0


def test_split_by_tensor_kind_keeps_plain_groups_whole() -> None:
    a, b = p(2), p(3)
    assert split_by_tensor_kind([a, b]) == [[a, b]]
    assert split_by_tensor_kind([]) == [[]]
