"""The monitors' own logic in one process: layer choice, counting over micro-batches, the file,
name patterns, and the errors a user can cause (raised before the first step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from meshforge.monitor.config import MoeMonitorConfig, TrainStateConfig
from meshforge.monitor.memory import memory_fields
from meshforge.monitor.moe import MoeMonitor
from meshforge.monitor.train_state import TrainStateMonitor, is_log_step
from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


class _Sparse(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(3, experts, bias=False)
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.gate(x).topk(2, dim=-1).indices
        self.last_tokens_per_expert = torch.bincount(top.reshape(-1), minlength=self.gate.out_features)
        return x


class _Layer(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.mlp: nn.Module = _Sparse(4) if sparse else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(5, 3)
        self.layers = nn.ModuleList([_Layer(False), _Layer(True), _Layer(True)])


class _Model(nn.Module):
    num_routed_experts = 4

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


def _moe(model: nn.Module, out: Path | None, **fields: object) -> MoeMonitor | None:
    cfg = MoeMonitorConfig(**fields)
    return MoeMonitor.build(cfg, model, log_interval=5, world=1, tp=1, device=CPU, output_dir=out)


def test_moe_counts_every_micro_batch_of_a_due_step_and_writes_the_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Model()
    monitor = _moe(model, tmp_path, save_tokens_per_expert_interval=2)
    assert monitor is not None and monitor.layers == [1, 2]
    x = torch.randn(6, 3)
    monitor.begin(1)  # not due: nothing counted, no collective, nothing written
    model(x)
    assert monitor.end(1) == ({}, [])
    monitor.begin(2)
    model(x)
    model(x[:2])
    record, lines = monitor.end(2)
    assert [line["layer"] for line in lines] == [1, 2]
    assert all(sum(line["counts"]) == (6 + 2) * 2 for line in lines)
    first = lines[0]["counts"]
    assert record["moe_load_ratio/layer1"] == pytest.approx(max(first) / (sum(first) / 4), rel=1e-12)
    assert record["moe_max_load_ratio"] == max(
        record["moe_load_ratio/layer1"], record["moe_load_ratio/layer2"]
    )
    written = [
        json.loads(line) for line in (tmp_path / "moe" / "tokens_per_expert.jsonl").read_text().splitlines()
    ]
    assert written == lines
    # A resumed run keeps the lines up to its step; a fresh one starts the file again.
    monitor.close()
    resumed = MoeMonitor.build(
        MoeMonitorConfig(target_layers=[2]),
        model,
        log_interval=5,
        world=1,
        tp=1,
        device=CPU,
        output_dir=tmp_path,
        resume_step=2,
    )
    assert resumed is not None and resumed.layers == [2] and resumed.interval == 5
    assert (tmp_path / "moe" / "tokens_per_expert.jsonl").read_text().count("\n") == 2
    _moe(model, tmp_path, target_layers=2)
    assert (tmp_path / "moe" / "tokens_per_expert.jsonl").read_text() == ""


class _GatedSparse(_Sparse):
    """The toy block with its output depending on the router (so backward needs the region)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        top = logits.topk(2, dim=-1).indices
        self.last_tokens_per_expert = torch.bincount(top.reshape(-1), minlength=self.gate.out_features)
        return x * logits.sigmoid().mean(-1, keepdim=True)


def test_moe_counts_a_recomputed_layer_once() -> None:
    from meshforge.memory.recompute import checkpoint_module

    torch.manual_seed(0)
    model = _Model()
    for layer in model.model.layers[1:]:
        layer.mlp = _GatedSparse(4)
        checkpoint_module(layer)
    monitor = _moe(model, None, save_tokens_per_expert_interval=1)
    assert monitor is not None
    monitor.begin(1)
    model(torch.randn(6, 3, requires_grad=True)).sum().backward()  # backward recomputes both layers
    _record, lines = monitor.end(1)
    assert [sum(line["counts"]) for line in lines] == [6 * 2, 6 * 2]


def test_moe_monitor_errors_name_the_key() -> None:
    model = _Model()
    assert _moe(model, None) is None  # off
    assert _moe(model, None, target_layers=2).layers == [1]  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"monitor.moe_monitor.target_layers: \[0\] are not MoE layers .*\[1, 2\]"
    ):
        _moe(model, None, target_layers=[0, 1])
    with pytest.raises(ValueError, match=r"target_layers: 1: none of the first 1 layers is an MoE layer"):
        _moe(model, None, target_layers=1)
    with pytest.raises(ValueError, match=r"^monitor.moe_monitor: the model has no MoE layer"):
        _moe(nn.Linear(2, 2), None, save_tokens_per_expert_interval=1)


def test_train_state_patterns_and_one_rank_values() -> None:
    model = _Model()
    assert TrainStateMonitor.build(TrainStateConfig(), model, rank=0, world=1, pp=1, device=CPU) is None
    cfg = TrainStateConfig(local_norm="*embed_tokens*", device_norm=True, local_loss=True, device_loss=True)
    monitor = TrainStateMonitor.build(cfg, model, rank=0, world=1, pp=1, device=CPU)
    assert monitor is not None and monitor.names == ["model.embed_tokens.weight"]
    model.model.embed_tokens.weight.grad = torch.full((5, 3), 2.0)
    model.model.layers[1].mlp.gate.weight.grad = torch.ones(4, 3)
    record = monitor.collect(model, loss_sum=30.0, local_tokens=10, normalizer=20.0)
    assert record["local_norm/model.embed_tokens.weight"] == pytest.approx((15 * 4.0) ** 0.5, rel=1e-12)
    assert record["device_norm/rank0"] == pytest.approx((15 * 4.0 + 12) ** 0.5, rel=1e-12)
    assert record["local_loss/rank0"] == 3.0 and record["device_loss/rank0"] == 1.5
    every = TrainStateMonitor.build(
        TrainStateConfig(local_norm=True), model, rank=0, world=1, pp=1, device=CPU
    )
    assert every is not None and len(every.names) == len(list(model.parameters()))
    with pytest.raises(
        ValueError, match=r"monitor.train_state.local_norm: pattern 'q_proj' matches no parameter"
    ):
        TrainStateMonitor.build(
            TrainStateConfig(local_norm=["*gate*", "q_proj"]), model, rank=0, world=1, pp=1, device=CPU
        )


def test_log_steps_and_memory_fields() -> None:
    assert [s for s in range(1, 11) if is_log_step(s, 4, 10)] == [1, 4, 8, 10]
    fields = memory_fields(CPU, host=True)
    assert set(fields) == {"memory_bytes", "cpu_memory_bytes", "cpu_memory_peak_bytes"}
    assert 0 < fields["cpu_memory_bytes"] <= fields["cpu_memory_peak_bytes"]
    assert set(memory_fields(CPU, host=False)) == {"memory_bytes"}


@pytest.mark.usefixtures("leave_no_process_group")
def test_a_monitor_error_comes_before_the_first_step(tiny_config: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(tiny_config),
        [f"training.output_dir={tiny_config.parent / 'dense'}", "monitor.moe_monitor.target_layers=[0]"],
    )
    trainer = Trainer(cfg, log=lambda _msg: None)
    with pytest.raises(ValueError, match="monitor.moe_monitor: the model has no MoE layer"):
        trainer.setup()
    assert trainer.step == 0
