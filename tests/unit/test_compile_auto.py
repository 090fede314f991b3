"""`kernels.compile: auto`, the eager fallback of a layer that fails to compile, and the loss rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.config import config_from_dict
from meshforge.models.common.compile import (
    CPU_PAYBACK_SECONDS,
    RunLength,
    apply_compile,
    decide_compile,
    decoder_layers,
)
from meshforge.models.common.kernels import (
    FUSED_CE_MIN_VOCAB,
    configure_model_kernels,
    resolve_kernel_options,
)
from meshforge.models.qwen3.args import Qwen3Args
from meshforge.models.qwen3.model import build_qwen3
from tests._compare import assert_close

CPU = torch.device("cpu")


def _qwen3(vocab: int = 96):
    args = Qwen3Args(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return build_qwen3(args, device="cpu")


def test_auto_rule() -> None:
    # 600 s at 50 GFLOP/s = 3e13 FLOPs.
    long = RunLength(steps=1000, tokens_per_step=1000, flops_per_token=3e7)
    short = RunLength(steps=10, tokens_per_step=1000, flops_per_token=3e7)
    assert decide_compile("auto", device_type="cpu", run=long).on
    decision = decide_compile("auto", device_type="cpu", run=short)
    assert not decision.on
    assert decision.reason == (
        "kernels.compile: auto -> off (cpu; 10 steps to run, estimated at 6 s eager at 50 GFLOP/s; "
        "compiling pays back from about 10 min)"
    )
    assert CPU_PAYBACK_SECONDS == 600
    assert (
        decide_compile("auto", device_type="cuda", run=short).reason == "kernels.compile: auto -> on (cuda)"
    )
    unknown = decide_compile("auto", device_type="cpu", run=RunLength(None, 0, None))
    assert not unknown.on and "depends on the data" in unknown.reason
    assert decide_compile(True, device_type="cpu", run=short).on
    assert not decide_compile(False, device_type="cuda", run=long).on


def test_a_resumed_run_counts_only_the_steps_it_has_left(tmp_path: Path) -> None:
    import json
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from meshforge.train.build_model import _run_length

    model = _qwen3()
    step = tmp_path / "checkpoints" / "checkpoint-00000400"
    step.mkdir(parents=True)
    dcp.save({"weight": torch.zeros(2)}, checkpoint_id=step)  # a real, loadable step folder
    (step / "trainer_state.json").write_text(json.dumps({"step": 400}))
    (step / "COMPLETE").write_text("")
    training = config_from_dict({"training": {"steps": 403}}).training

    def length(load_path: str, *, no_load_optim: bool = False) -> RunLength:
        env = SimpleNamespace(
            load_path=load_path, plan=SimpleNamespace(global_batch_size=4), dims=SimpleNamespace(world_size=1)
        )
        return _run_length(model, training, seq=32, env=env, no_load_optim=no_load_optim)  # type: ignore[arg-type]

    assert length("").steps == 403
    assert length(str(tmp_path / "checkpoints")).steps == 3  # the run folder: its latest step
    assert length(str(step)).steps == 3
    assert length(str(step), no_load_optim=True).steps == 403  # weights only: step 0
    assert length(str(tmp_path / "missing")).steps == 403  # resume reports the folder


def test_the_compile_line_says_how_long_the_first_step_compiles() -> None:
    lines: list[str] = []
    names = apply_compile(_qwen3(), backend="inductor", warn=pytest.fail, log=lines.append)
    assert len(names) == 3
    assert lines == [
        "kernels.compile: compiling decoder layers (3 layer(s), 1 graph(s), backend inductor) at the "
        "first step: about 30 s cold, a few seconds with a warm inductor cache"
    ]


def _options(vocab: int, **kernels: object):
    cfg = config_from_dict({"kernels": kernels}).kernels
    return resolve_kernel_options(cfg, device=CPU, compute_dtype=torch.float32, vocab_size=vocab)


def test_fused_loss_rule() -> None:
    assert _options(FUSED_CE_MIN_VOCAB).lm_loss().mode == "fused"
    assert _options(FUSED_CE_MIN_VOCAB - 1).lm_loss().mode == "logits"
    assert _options(151_936).lm_loss().chunk_size == 512
    # chunk_loss_size asks for the recomputing chunked loss; with fused true it sets the chunk.
    assert _options(151_936, chunk_loss_size=64).lm_loss().mode == "chunked"
    assert _options(96, chunk_loss_size=64, fused_linear_cross_entropy=True).lm_loss().chunk_size == 64
    assert _options(96, fused_linear_cross_entropy=True).lm_loss().mode == "fused"
    assert _options(151_936, fused_linear_cross_entropy=False).lm_loss().mode == "logits"
    cfg = config_from_dict({}).kernels
    split = resolve_kernel_options(
        cfg, device=CPU, compute_dtype=torch.float32, vocab_size=151_936, loss_parallel=True
    )
    assert split.lm_loss().mode == "logits"
    # No run length given: auto stays eager on the CPU; compiled losses carry the backend.
    assert not _options(96).compile
    assert _options(96, compile=True, compile_backend="aot_eager").lm_loss().compile_backend == "aot_eager"


def test_fused_auto_turns_off_for_a_model_without_hidden_output_and_true_is_refused() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not configure_model_kernels(plain, _options(151_936), family="other").fused_ce
    with pytest.raises(ValueError, match="^kernels.fused_linear_cross_entropy: the other model"):
        configure_model_kernels(plain, _options(96, fused_linear_cross_entropy=True), family="other")


def test_compile_auto_turns_off_for_a_model_without_decoder_layers_and_true_is_refused() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    cfg = config_from_dict({}).kernels
    on = resolve_kernel_options(cfg, device=torch.device("cuda"), compute_dtype=torch.float32, vocab_size=4)
    assert on.compile and on.compile_auto
    off = configure_model_kernels(plain, on, family="other")
    assert not off.compile
    assert off.compile_reason == "kernels.compile: auto -> off (Sequential has no model.layers to compile)"
    forced = _options(4, compile=True)
    assert configure_model_kernels(plain, forced, family="other").compile  # apply_compile then names the key
    with pytest.raises(ValueError, match="^kernels.compile: Sequential has no model.layers"):
        apply_compile(plain)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler on this machine")


def test_a_layer_that_fails_to_compile_runs_eagerly_with_one_warning() -> None:
    torch._dynamo.reset()
    eager, compiled = _qwen3(), _qwen3()
    compiled.load_state_dict(eager.state_dict())
    warnings: list[str] = []
    names = apply_compile(compiled, backend=_failing_backend, warn=warnings.append)  # type: ignore[arg-type]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    ids = torch.randint(0, 96, (2, 12))
    assert_close(compiled(ids), eager(ids))
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "warning: kernels.compile: model.layers.0 (Qwen3DecoderLayer) failed to compile and runs eagerly, "
        "with every other Qwen3DecoderLayer: BackendCompilerFailed"
    )
    assert "no compiler on this machine" in warnings[0]
    assert all(layer._compiled_call_impl is None for layer in compiled.model.layers)
    compiled(ids).sum().backward()  # eager from now on: no further warning
    assert len(warnings) == 1


class _Checked(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 4:
            raise ValueError(f"expected 4 features, got {x.shape[-1]}")
        return x * 2


def test_a_real_error_in_a_compiled_layer_is_raised_not_hidden() -> None:
    torch._dynamo.reset()
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([_Checked()])
    warnings: list[str] = []
    apply_compile(model, backend="eager", warn=warnings.append)
    layer = model.model.layers[0]
    assert_close(layer(torch.ones(2, 4)), torch.full((2, 4), 2.0))
    with pytest.raises(ValueError, match="expected 4 features, got 3"):
        layer(torch.ones(2, 3))
    assert warnings == []
    assert layer._compiled_call_impl is not None


def test_decoder_layers_of_a_pipeline_stage_and_a_model_without_layers() -> None:
    model = _qwen3()
    model.model.layers = torch.nn.ModuleDict({"1": model.model.layers[1], "2": model.model.layers[2]})
    assert [name for name, _ in decoder_layers(model)] == ["model.layers.1", "model.layers.2"]
    with pytest.raises(ValueError, match="^kernels.compile: Linear has no model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_compiled_layers_with_aot_eager_match_eager_forward_and_backward() -> None:
    torch._dynamo.reset()
    eager, compiled = _qwen3(), _qwen3()
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, backend="aot_eager", warn=pytest.fail)
    ids = torch.randint(0, 96, (2, 12))
    segments = torch.tensor([[1] * 5 + [2] * 7, [1] * 12])
    for model in (eager, compiled):
        model(ids, segment_ids=segments).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert_close(b.grad, a.grad, rtol=1e-5), name


def test_trainer_logs_the_decision_and_a_short_cpu_run_stays_eager(tiny_config: Path, tmp_path: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    lines: list[str] = []
    cfg = load_config(
        str(tiny_config),
        ["--training.steps=2", f"--training.output_dir={tmp_path / 'out'}", "--checkpoint.enable_save=false"],
    )
    trainer = Trainer(cfg, log=lines.append)
    try:
        trainer.setup()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    decision = [line for line in lines if line.startswith("kernels.compile: auto -> ")]
    assert len(decision) == 1, lines
    assert decision[0].startswith("kernels.compile: auto -> off (cpu; 2 steps to run, estimated at ")
    assert decision[0].endswith("; loss: full-logits loss")
    assert all(layer._compiled_call_impl is None for layer in trainer.model.model.layers)
