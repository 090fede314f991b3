"""The run-level loss rules: one fused-loss rule for the trainer and the memory planner, and a
`kernels.compile: auto` decision that measures the machine only when the run length leaves it open."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from meshforge.config import config_from_dict
from meshforge.loss.lm import LMLoss
from meshforge.models.common.compile import (
    CPU_PAYBACK_SECONDS,
    CPU_TRAINING_FLOPS,
    RunLength,
    decide_compile,
)
from meshforge.models.common.kernels import (
    FUSED_CE_MIN_VOCAB,
    configure_model_kernels,
    resolve_kernel_options,
    supports_hidden_output,
)
from meshforge.models.qwen3.args import Qwen3Args
from meshforge.models.qwen3.model import build_qwen3
from meshforge.parallel.plan import plan_lm_loss

CPU = torch.device("cpu")


def _qwen3(vocab: int) -> nn.Module:
    args = Qwen3Args(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    return build_qwen3(args, device="meta")


class _LogitsOnly(nn.Module):
    """A model with a bias-free head but no ``return_hidden`` (as the generic path's models)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8, device="meta")
        self.lm_head = nn.Linear(8, vocab, bias=False, device="meta")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(input_ids))


def _trainer_loss(cfg, model: nn.Module) -> LMLoss | None:
    """The loss the trainer's build picks for ``model`` (None: it refuses the settings)."""
    vocab = int(model.get_submodule("lm_head").weight.shape[0])
    options = resolve_kernel_options(
        cfg.kernels,
        device=CPU,
        compute_dtype=torch.float32,
        vocab_size=vocab,
        loss_parallel=cfg.parallelism.tensor_parallel > 1 and cfg.parallelism.enable_loss_parallel,
        hidden_output=supports_hidden_output(model),
    )
    try:
        return configure_model_kernels(model, options, family="test").lm_loss()
    except ValueError:
        return None


GRID = list(
    itertools.product(
        [True, False, "auto"],  # fused_linear_cross_entropy
        [None, 64],  # chunk_loss_size
        [False, True],  # TP with loss parallelism
        [FUSED_CE_MIN_VOCAB - 1, FUSED_CE_MIN_VOCAB],
        [True, False],  # the model returns hidden states
    )
)


@pytest.mark.parametrize(("fused", "chunk", "loss_parallel", "vocab", "hidden"), GRID)
def test_the_planner_traces_the_loss_the_trainer_trains(fused, chunk, loss_parallel, vocab, hidden) -> None:
    kernels: dict[str, object] = {"fused_linear_cross_entropy": fused}
    if chunk is not None:
        kernels["chunk_loss_size"] = chunk
    parallelism = {"tensor_parallel": 2, "enable_loss_parallel": True} if loss_parallel else {}
    cfg = config_from_dict({"kernels": kernels, "parallelism": parallelism})
    model = _qwen3(vocab) if hidden else _LogitsOnly(vocab)
    planned = plan_lm_loss(cfg, model)
    trained = _trainer_loss(cfg, model)
    if trained is None:
        # The trainer refuses a head-applying loss on a model without hidden output; the
        # planner names the same loss, whose trace then fails and says why.
        assert not hidden and planned.needs_hidden
        return
    assert planned == trained
    expected_fused = fused is True or (
        fused == "auto" and chunk is None and not loss_parallel and vocab >= FUSED_CE_MIN_VOCAB and hidden
    )
    assert (planned.mode == "fused") == expected_fused


def test_the_planner_keeps_full_logits_for_a_model_without_hidden_output() -> None:
    cfg = config_from_dict({})
    assert plan_lm_loss(cfg, _LogitsOnly(151_936)) == LMLoss()
    assert plan_lm_loss(cfg, _qwen3(151_936)) == LMLoss("fused", 512)


def test_the_auto_rule_is_the_work_against_a_fixed_rate_not_a_measurement(monkeypatch) -> None:
    # Work at which the run takes exactly the payback time at the fixed CPU rate.
    at_payback = CPU_PAYBACK_SECONDS * CPU_TRAINING_FLOPS
    import torch as torch_module

    def no_timing(*args, **kwargs):
        raise AssertionError("the rule measured the machine")

    monkeypatch.setattr(torch_module, "mm", no_timing)
    for work in (at_payback * 0.5, at_payback * 0.999, at_payback, at_payback * 4):
        run = RunLength(steps=1000, tokens_per_step=1000, flops_per_token=work / 1e6)
        decision = decide_compile("auto", device_type="cpu", run=run)
        assert decision.on == (work >= at_payback), (work, decision)
        assert decision.reason.startswith(f"kernels.compile: auto -> {'on' if decision.on else 'off'} (cpu; ")
    short = decide_compile("auto", device_type="cpu", run=RunLength(2, 64, 1e6))
    assert short.reason == (
        "kernels.compile: auto -> off (cpu; 2 steps to run, estimated at 1 s eager at 50 GFLOP/s; "
        "compiling pays back from about 10 min)"
    )


def test_the_trainer_counts_the_flops_of_a_token_once(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    import meshforge.monitor.throughput as throughput
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    counted: list[int] = []
    count = throughput.model_flops_per_token

    def counting(model: nn.Module, seq_len: int) -> float:
        counted.append(seq_len)
        return count(model, seq_len)

    monkeypatch.setattr(throughput, "model_flops_per_token", counting)
    cfg = load_config(
        str(tiny_config),
        [
            "--training.steps=2",
            "--training.log_throughput=true",
            f"--training.output_dir={tmp_path / 'out'}",
            "--checkpoint.enable_save=false",
        ],
    )
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    try:
        trainer.setup()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert counted == [32]  # the compile rule and the throughput log share one count
    assert trainer.run.model.flops_per_token == count(trainer.model, 32)
    decision = [line for line in lines if line.startswith("kernels.compile: auto -> ")]
    assert decision and "2 steps to run" in decision[0]  # the rule used that count
