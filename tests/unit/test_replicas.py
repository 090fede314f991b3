"""torchft replica groups without processes: the group index, the data shards, the recovery state, the step's sums.

The whole path (quorum, a SIGKILLed group, recovery over HTTP) runs in
tests/distributed/test_torchft.py; here a fake manager stands for torchft's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from meshforge.config import config_from_dict
from meshforge.train.replica_state import ReplicaStateFns
from meshforge.train.replicas import ReplicaGroup, data_shard, lighthouse_address, replica_id
from meshforge.train.run import Progress

BASE: dict[str, Any] = {
    "model": {"model_type": "qwen3"},
    "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}},
    "context": {"device_target": "cpu"},
}


def _parallelism(**ft: Any) -> Any:
    return config_from_dict({**BASE, "parallelism": {"fault_tolerance": {"enable": True, **ft}}}).parallelism


def test_replica_id_from_the_config_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REPLICA_GROUP_ID", "TORCHFT_REPLICA_ID", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    assert replica_id(_parallelism(replica_id=1).fault_tolerance) == 1
    ft = _parallelism(replica_groups=3).fault_tolerance
    with pytest.raises(ValueError, match="parallelism.fault_tolerance.replica_id"):
        replica_id(ft)
    monkeypatch.setenv("TORCHFT_REPLICA_ID", "2")
    assert replica_id(ft) == 2
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    with pytest.raises(ValueError, match=r"REPLICA_GROUP_ID='3'.*\[0, .*replica_groups=3\)"):
        replica_id(ft)
    with pytest.raises(ValueError, match="parallelism.fault_tolerance.lighthouse"):
        lighthouse_address(ft)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:1")
    assert lighthouse_address(ft) == "http://h:1"


def test_each_group_reads_its_own_shards() -> None:
    par = _parallelism(replica_groups=3, replica_id=2)
    assert data_shard(par, dp_rank=1, dp_size=2) == (5, 6)
    off = config_from_dict(BASE).parallelism
    assert data_shard(off, dp_rank=1, dp_size=2) == (1, 2)


@dataclass
class _Loader:
    position: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _parts(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def test_a_recovering_group_takes_the_peers_whole_state() -> None:
    model, optimizer, scheduler = _parts(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    peer = ReplicaStateFns(
        model, optimizer, scheduler, _Loader(12).state_dict, _Loader().load_state_dict, Progress(3, 96), print
    )
    fresh_model, fresh_optimizer, fresh_scheduler = _parts(1)
    loader, progress, told = _Loader(), Progress(), []
    mine = ReplicaStateFns(
        fresh_model,
        fresh_optimizer,
        fresh_scheduler,
        loader.state_dict,
        loader.load_state_dict,
        progress,
        lambda old, new: told.append((old, new)),
    )
    mine.load_state_dict(peer.state_dict())
    for got, want in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert (loader.position, progress.step, progress.tokens_seen, told) == (12, 3, 96, [(0, 3)])


@dataclass
class _Manager:
    """torchft's `Manager` as the step uses it: every all-reduce sums `groups` equal contributions."""

    groups: int
    participants: list[int] = field(default_factory=list)
    commit: bool = True
    quorums: int = 0

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> _Manager:
        assert reduce_op == ReduceOp.SUM
        tensor.mul_(self.groups)
        return self

    def wait(self) -> bool:
        return True

    def start_quorum(self) -> None:
        self.quorums += 1

    def num_participants(self) -> int:
        return self.participants[min(self.quorums, len(self.participants)) - 1]

    def should_commit(self) -> bool:
        return self.commit

    def shutdown(self, wait: bool = True) -> None:
        pass


def _group(manager: _Manager, *, fresh: bool) -> ReplicaGroup:
    return ReplicaGroup(
        manager,  # type: ignore[arg-type]
        replica_id=0,
        groups=2,
        first_quorum_timeout_s=1.0,
        fresh=fresh,
        log=print,
    )


def test_tokens_gradients_and_loss_are_summed_over_the_groups() -> None:
    group = _group(_Manager(groups=2, participants=[2]), fresh=False)
    group.start_step()
    assert int(group.sum_tokens(torch.tensor(7))) == 14
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones_like(model.weight)  # bias: no gradient yet, summed as zeros
    loss = group.reduce_step(model, torch.tensor(1.5))
    assert float(loss) == 3.0 and torch.equal(model.weight.grad, torch.full((2, 3), 2.0))
    assert model.bias.grad is not None and not model.bias.grad.any()
    assert group.should_commit() and group.fields() == {"replicas": 2, "replica_committed": True}


def test_a_fresh_run_waits_for_every_group_before_its_first_step() -> None:
    manager = _Manager(groups=2, participants=[1, 1, 2])
    group = _group(manager, fresh=True)
    group.start_step()
    assert manager.quorums == 3 and group.fields()["replicas"] == 2
    group.start_step()  # later steps ask once
    assert manager.quorums == 4


def test_an_unreachable_lighthouse_is_one_error_naming_the_key() -> None:
    pytest.importorskip("torchft")
    from meshforge.train.replicas import build_replicas

    model, optimizer, scheduler = _parts(0)
    loader = _Loader()
    ft = _parallelism(replica_id=0, lighthouse="http://localhost:1", timeout_s=1).fault_tolerance
    with pytest.raises(
        ValueError, match=r"parallelism.fault_tolerance.lighthouse: cannot reach http://localhost:1"
    ):
        build_replicas(
            ft,
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            data_parallel=1,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loader=loader,  # type: ignore[arg-type]
            progress=Progress(),
            log=print,
        )
