"""`meshforge plan`: candidate layouts priced by the memory plan and the step-time model, ranked,
the config's own layout beside them, a refusal explained, and the chosen layout written back."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meshforge.cli.main import main
from meshforge.config.loader import load_config
from meshforge.parallel.device_peak import peak_lines
from meshforge.parallel.dims import ParallelDims
from meshforge.parallel.layout_search import search
from meshforge.parallel.step_time import predict_step
from meshforge.utils.hardware import hardware

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "tokenizer_name_or_path": "meshforge://assets/tokenizer",
}


def _write(tmp_path: Path) -> Path:
    data = {
        "model": {**TINY_MOE, "params_dtype": "float32", "compute_dtype": "bfloat16"},
        "train_dataset": {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 2048}},
        "training": {"local_batch_size": 1, "global_batch_size": 16, "steps": 10},
        "parallelism": {"expert_parallel": 2},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_search_ranks_valid_fitting_layouts(tmp_path: Path) -> None:
    cfg = load_config(str(_write(tmp_path)))
    hw = hardware("h100")
    result = search(cfg, 4, hw)
    assert result.ranked and result.own is not None
    speeds = [r.prediction.tokens_per_device for r in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert speeds[0] >= result.own.prediction.tokens_per_device
    kinds = {(r.layout.ep, r.layout.pp, r.layout.recompute) for r in result.ranked}
    assert {ep for ep, _, _ in kinds} >= {1, 2, 4} and {pp for _, pp, _ in kinds} >= {1, 2}
    # The interleaved zero-bubble schedule and float8 linears (the H100 has fp8 tensor cores) are
    # candidates too.
    priced = result.ranked + result.too_big
    assert {r.layout.schedule for r in priced if r.layout.pp > 1} == {
        "1f1b",
        "interleaved1f1b",
        "interleavedzerobubble",
    }
    assert {r.layout.quant for r in priced} == {None, "tensorwise"}
    assert hardware("a100").fp8_flops is None and not any(
        r.layout.quant for r in search(cfg, 2, hardware("a100")).ranked
    )
    for entry in result.ranked[:20]:
        assert entry.peak_bytes <= result.limit_bytes
    # The config as written is priced exactly as `config validate --device` prices it.
    own = predict_step(cfg, 4, hw)
    assert result.own.prediction.step == pytest.approx(own.step, rel=1e-12)
    peak_line = next(line for line in peak_lines(cfg, 4) if line.startswith("predicted peak"))
    assert f"= {result.own.peak_bytes / 1024**3:.2f} GiB on the device" in peak_line


def test_plan_writes_the_best_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write(tmp_path)
    out = tmp_path / "best.yaml"
    assert (
        main(["plan", str(src), "--world-size", "4", "--device", "h100", "--top", "3", "-o", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "layout(s) fit" in printed and " own " in printed
    written = load_config(str(out))
    best = search(load_config(str(src)), 4, hardware("h100")).ranked[0].layout
    par = written.parallelism
    assert (par.tensor_parallel, par.context_parallel, par.pipeline_parallel, par.expert_parallel) == (
        best.tp,
        best.cp,
        best.pp,
        best.ep,
    )
    assert written.training.local_batch_size == best.micro
    assert written.model.quant_recipe_name == best.quant
    assert written.training.global_batch_size == 16 and written.model.hidden_size == 64
    ParallelDims.from_config(par, 4)  # a valid layout for 4 ranks


def test_plan_explains_a_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write(tmp_path)
    code = main(["plan", str(src), "--world-size", "4", "--device", "a100", "--device-memory", "0.001"])
    assert code == 2
    out = capsys.readouterr().out
    assert "no layout fits 0.0 GiB on NVIDIA A100" in out and "the smallest predicted peak is" in out


def test_plan_writes_native_yaml_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = ROOT / "configs/megatron/pretrain_qwen3_tiny.sh"
    out = tmp_path / "best.yaml"
    assert main(["plan", str(script), "--world-size", "2", "--device", "h100", "-o", str(out)]) == 2
    assert "-o: writes native YAML only" in capsys.readouterr().err and not out.exists()
    assert main(["plan", str(_write(tmp_path)), "--world-size", "0", "--device", "h100"]) == 2
    assert "--world-size: must be >= 1" in capsys.readouterr().err
