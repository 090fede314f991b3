"""Gradient clipping, weight-decay groups and AdamW on FSDP2 DTensor parameters (2 processes, gloo).

One launch runs several checks against a single-process reference computed on full tensors:
the global norm (sharded, unevenly sharded, replicated and plain gradients mixed), the clipped
gradients, the non-finite path, the weight-decay split by name, and a fused AdamW step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(7, 6)  # 7 rows: uneven shards over 2 ranks
        self.model.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 5)])
        self.model.norm = nn.LayerNorm(5)
        self.lm_head = nn.Linear(5, 7, bias=False)


def _full_grads(model: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(p.shape, generator=g) * scale for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor, init_device_mesh

    from meshforge.optim.build import build_optimizer
    from meshforge.optim.clip import clip_grad_norm_
    from meshforge.optim.param_groups import split_weight_decay

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))

    def sharded_net() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        ref = Net()
        net = Net()
        net.load_state_dict(ref.state_dict())
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, ref

    for scale in (0.01, 10.0):
        net, ref = sharded_net()
        grads = _full_grads(ref, scale)
        for n, p in net.named_parameters():
            assert isinstance(p, DTensor), n
            p.grad = distribute_tensor(grads[n], mesh, p.placements)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        norm = clip_grad_norm_(net.parameters(), 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        assert not isinstance(norm, DTensor) and norm.dim() == 0 and norm.dtype == torch.float32
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9, msg=n)

    # A replicated DTensor must count once, not once per rank; plain tensors join the sum.
    rep = nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))
    rep.grad = distribute_tensor(torch.tensor([3.0, 0.0, 0.0]), mesh, [Replicate()])
    plain = nn.Parameter(torch.zeros(2))
    plain.grad = torch.tensor([0.0, 4.0])
    net, _ = sharded_net()
    emb = net.model.embed_tokens.weight
    emb.grad = distribute_tensor(torch.full((7, 6), 0.5), mesh, emb.placements)  # norm sqrt(10.5)
    norm = clip_grad_norm_([rep, plain, emb], 100.0)
    torch.testing.assert_close(norm, torch.tensor((9 + 16 + 10.5) ** 0.5))

    # Non-finite: returned, grads untouched, identical on both ranks.
    emb.grad = distribute_tensor(torch.full((7, 6), 0.5), mesh, emb.placements)
    if rank == 1:
        emb.grad.to_local().view(-1)[0] = float("inf")
    norm = clip_grad_norm_([emb], 1.0)
    assert torch.isinf(norm), norm
    assert torch.equal(emb.grad.to_local().isfinite().sum(), torch.tensor(emb.grad.to_local().numel() - rank))

    # Weight-decay split by name and global dims; fused AdamW on DTensors matches full tensors.
    net, ref = sharded_net()
    groups = split_weight_decay(net.named_parameters(), weight_decay_exclude=["embed_tokens"])
    assert [n for n, _ in groups.decay] == [
        "model.layers.0.weight",
        "model.layers.1.weight",
        "lm_head.weight",
    ]
    kw = dict(
        type="AdamW",
        learning_rate=0.01,
        betas=[0.9, 0.95],
        eps=1e-8,
        weight_decay=0.1,
        weight_decay_include=None,
        weight_decay_exclude=["embed_tokens"],
        options={},
    )
    opt = build_optimizer(net.named_parameters(), **kw)
    ref_opt = build_optimizer(ref.named_parameters(), **kw)
    assert opt.defaults["fused"] is True
    grads = _full_grads(ref, 1.0)
    for _ in range(2):
        for n, p in net.named_parameters():
            p.grad = distribute_tensor(grads[n], mesh, p.placements)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        ref_opt.step()
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        # Same fused kernel, element-wise: the shards equal the full-tensor update exactly.
        assert torch.equal(p.full_tensor(), q.detach()), n


def test_clip_and_adamw_on_fsdp2_dtensors() -> None:
    run_workers(_worker, WORLD)
