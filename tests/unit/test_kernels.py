"""Kernel switches (`kernels:`) and the chunked loss: same numbers as the plain paths, clear refusals."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.config import config_from_dict  # noqa: E402
from meshforge.loss.cross_entropy import chunked_cross_entropy_sum, cross_entropy_sum  # noqa: E402
from meshforge.models.common.kernels import (  # noqa: E402
    KernelOptions,
    apply_compile,
    configure_model_kernels,
    resolve_kernel_options,
)
from meshforge.models.common.moe import MoEBlock  # noqa: E402
from meshforge.models.common.norms import RMSNorm  # noqa: E402
from meshforge.models.llama.args import LlamaArgs  # noqa: E402
from meshforge.models.llama.model import build_llama  # noqa: E402
from meshforge.models.qwen3.args import Qwen3Args  # noqa: E402
from meshforge.models.qwen3.model import build_qwen3  # noqa: E402
from meshforge.models.qwen3_moe.args import Qwen3MoeArgs  # noqa: E402
from meshforge.models.qwen3_moe.model import build_qwen3_moe  # noqa: E402
from tests._compare import assert_close  # noqa: E402
from tests.conftest import read_metrics, run_train  # noqa: E402
from tests.distributed._layouts import train_one  # noqa: E402

CPU = torch.device("cpu")
COMMON = dict(vocab_size=96, hidden_size=32, max_position_embeddings=128, rope_theta=10_000.0)


def _qwen3(tied: bool = False):
    args = Qwen3Args(
        **COMMON,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    return build_qwen3(args, device="cpu")


def _llama():
    args = LlamaArgs(
        **COMMON, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return build_llama(args, device="cpu")


def _moe(tied: bool = True):
    args = Qwen3MoeArgs(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=tied,
    )
    return build_qwen3_moe(args, device="cpu")


def _kernels(**values):
    return config_from_dict({"kernels": values}).kernels


def _resolve(**values) -> KernelOptions:
    return resolve_kernel_options(_kernels(**values), device=CPU, compute_dtype=torch.float32)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _batch(seed: int = 0, batch: int = 2, seq: int = 11):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (batch, seq), generator=gen)
    labels = torch.randint(0, 96, (batch, seq), generator=gen)
    labels[0, :3] = -100  # ignored positions (prompt, padding)
    return ids, labels


# ----------------------------------------------------------------------------- chunked loss
@pytest.mark.parametrize("chunk_size", [1, 5, 22, 1000])
def test_chunked_cross_entropy_equals_plain_loss_and_gradients(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(2, 11, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 11))
    labels[1, 4:] = -100
    plain = cross_entropy_sum(hidden @ weight.t(), labels)
    (plain / 7).backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size)
    (chunked / 7).backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    assert_close(hidden.grad, ref_h, what="hidden grad")
    assert_close(weight.grad, ref_w, what="weight grad")


def test_chunked_cross_entropy_keeps_no_full_logits():
    """No tensor of a whole sequence's logits is saved for backward (only inputs are)."""
    tokens, vocab, dim = 64, 500, 8
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=8)
    assert max(saved) < tokens * vocab
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        plain = cross_entropy_sum(hidden @ weight.t(), labels)
    assert max(saved) >= tokens * vocab  # the hook does see the plain path's logits
    torch.testing.assert_close(loss, plain)


def test_chunked_cross_entropy_under_bf16_autocast_matches_plain():
    torch.manual_seed(1)
    hidden = torch.randn(3, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (3, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = cross_entropy_sum(hidden @ weight.t(), labels)
    plain.backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=4)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weight.grad, ref_w, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "build",
    [_qwen3, lambda: _qwen3(tied=True), _llama, _moe],
    ids=["qwen3", "qwen3_tied", "llama", "qwen3_moe"],
)
def test_model_hidden_output_feeds_the_chunked_loss(build):
    model = build()
    configure_model_kernels(model, _resolve(chunk_loss_size=5), family="test")
    ids, labels = _batch()
    plain = cross_entropy_sum(model(ids), labels)
    plain.backward()
    ref = _grads(model)
    hidden = model(ids, return_hidden=True)
    chunked = chunked_cross_entropy_sum(hidden, model.lm_head.weight, labels, chunk_size=5)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    for name, grad in _grads(model).items():
        assert_close(grad, ref[name], what=name)


# ----------------------------------------------------------------------------- resolution
def test_switches_that_cannot_run_on_cpu_are_warned_no_ops_and_auto_turns_them_off_quietly():
    warnings: list[str] = []

    def resolve(**values) -> KernelOptions:
        return resolve_kernel_options(
            _kernels(**values), device=CPU, compute_dtype=torch.float32, warn=warnings.append
        )

    on = resolve(use_flash_attn=True, use_fused_rotary_pos_emb=True)
    assert (on.flash_attn, on.flash_attn_strict, on.fused_rope) == (False, False, False)
    assert len(warnings) == 2
    assert re.match(
        r"^warning: kernels.use_flash_attn: true has no effect here: flash attention needs a CUDA device.*set it to auto",
        warnings[0],
    )
    assert re.match(
        r"^warning: kernels.use_fused_rotary_pos_emb: true has no effect here: torch has no fused.*set it to auto",
        warnings[1],
    )
    warnings.clear()
    auto = resolve(use_flash_attn="auto", use_fused_rotary_pos_emb="auto", use_fused_rmsnorm="auto")
    assert (auto.flash_attn, auto.fused_rope, auto.fused_rmsnorm) == (False, False, True)
    assert warnings == []
    # The MindFormers alias reaches the same switch and the same warning.
    alias = config_from_dict({"model": {"use_flash_attention": True}}).kernels
    assert not resolve_kernel_options(
        alias, device=CPU, compute_dtype=torch.float32, warn=warnings.append
    ).flash_attn
    assert len(warnings) == 1 and warnings[0].startswith("warning: kernels.use_flash_attn:")


def test_rmsnorm_switch_default_is_the_family_default_and_false_is_the_reference():
    assert _resolve().fused_rmsnorm is None
    assert _resolve(use_fused_rmsnorm=False).fused_rmsnorm is False
    assert _resolve(use_fused_rmsnorm=True).fused_rmsnorm is True
    opts = _resolve(chunk_loss_size=64, compile=True, fix_router=True, moe_grouped_gemm=True)
    assert (opts.chunk_loss_size, opts.compile, opts.fix_router, opts.grouped_mm) == (64, True, True, True)


def test_flash_attn_on_cuda_needs_half_precision():
    cfg = _kernels(use_flash_attn=True)
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    warnings: list[str] = []
    fp32 = resolve_kernel_options(
        cfg, device=torch.device("cuda"), compute_dtype=torch.float32, warn=warnings.append
    )
    assert not fp32.flash_attn and "float16/bfloat16" in warnings[0]
    assert resolve_kernel_options(cfg, device=torch.device("cuda"), compute_dtype=torch.bfloat16).flash_attn


# ----------------------------------------------------------------------------- switches on models
def test_reference_rmsnorm_equals_fused_and_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    ours, hf = RMSNorm(24, 1e-6), Qwen3RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(24))
        hf.weight.copy_(ours.weight)
    assert transformers is not None
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 24).to(dtype)
        ours.fused = False
        reference = ours(x)
        assert torch.equal(reference, hf(x))
        ours.fused = True
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours(x), reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("build", [_qwen3, _llama, _moe], ids=["qwen3", "llama", "qwen3_moe"])
def test_plain_rmsnorm_and_auto_switches_give_the_same_model(build):
    model = build()
    ids, _ = _batch(3)
    default = model(ids)
    configure_model_kernels(
        model,
        _resolve(use_fused_rmsnorm=False, use_flash_attn="auto", use_fused_rotary_pos_emb="auto"),
        family="t",
    )
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and not any(m.fused for m in norms)
    assert_close(model(ids), default, what="logits")


def test_grouped_gemm_switch_gives_the_loop_numbers():
    model = _moe(tied=False)
    ids, labels = _batch(4)
    plain = cross_entropy_sum(model(ids), labels)
    plain.backward()
    ref = _grads(model)
    configure_model_kernels(model, _resolve(moe_grouped_gemm=True), family="qwen3_moe")
    assert all(layer.mlp.experts.use_grouped_mm for layer in model.model.layers)
    grouped = cross_entropy_sum(model(ids), labels)
    grouped.backward()
    torch.testing.assert_close(grouped, plain, rtol=1e-6, atol=1e-5)
    for name, grad in _grads(model).items():
        assert_close(grad, ref[name], what=name)


def test_fix_router_assigns_token_i_to_experts_i_k_plus_j_mod_e():
    model = _moe()
    configure_model_kernels(model, _resolve(fix_router=True), family="qwen3_moe")
    ids, labels = _batch(5, batch=2, seq=7)  # 14 tokens x 2 slots = 28 slots over 6 experts
    model(ids)
    block = model.model.layers[0].mlp
    assert isinstance(block, MoEBlock)
    assert block.last_tokens_per_expert.tolist() == [5, 5, 5, 5, 4, 4]
    tokens = block.gate.weight.new_empty(14, 32).normal_()
    probs, weights, indices = block.gate(tokens)
    expected = torch.tensor([[(i * 2 + j) % 6 for j in range(2)] for i in range(14)])
    assert torch.equal(indices, expected)
    chosen = probs.gather(1, expected)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    # The router still learns: its weight gets a gradient through the routing weights.
    cross_entropy_sum(model(ids), labels).backward()
    assert block.gate.weight.grad.abs().sum() > 0


def test_moe_switches_are_refused_on_dense_families_and_unknown_families():
    for key, opts in (
        ("fix_router", _resolve(fix_router=True)),
        ("moe_grouped_gemm", _resolve(moe_grouped_gemm=True)),
    ):
        with pytest.raises(ValueError, match=rf"^kernels.{key}: qwen3 has no MoE"):
            configure_model_kernels(_qwen3(), opts, family="qwen3")
    plain = torch.nn.Module()
    plain.forward = lambda input_ids: input_ids  # type: ignore[method-assign]
    with pytest.raises(
        ValueError, match="^kernels.use_fused_rmsnorm: not supported by the other model family"
    ):
        configure_model_kernels(plain, _resolve(use_fused_rmsnorm=True), family="other")
    configure_model_kernels(plain, _resolve(), family="other")  # no switch on: fine
    with pytest.raises(ValueError, match="^kernels.chunk_loss_size: the other model does not expose"):
        configure_model_kernels(plain, _resolve(chunk_loss_size=8), family="other")


def test_apply_compile_requires_decoder_layers():
    with pytest.raises(ValueError, match="^kernels.compile: .* has no model.layers"):
        apply_compile(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention runs on CUDA only")
def test_flash_attention_equals_plain_sdpa_on_cuda():
    model = _qwen3().to("cuda", torch.bfloat16)
    ids, labels = _batch(6, seq=64)
    ids, labels = ids.cuda(), labels.cuda()
    plain = cross_entropy_sum(model(ids), labels)
    opts = resolve_kernel_options(
        _kernels(use_flash_attn=True), device=torch.device("cuda"), compute_dtype=torch.bfloat16
    )
    configure_model_kernels(model, opts, family="qwen3")
    torch.testing.assert_close(cross_entropy_sum(model(ids), labels), plain, rtol=2e-2, atol=0.5)
    with pytest.raises(ValueError, match="packs documents"):
        model(ids, segment_ids=torch.ones_like(ids))


# ----------------------------------------------------------------------------- through the trainer
@pytest.mark.procs
def test_trainer_chunk_loss_size_gives_the_same_losses_and_flash_true_is_a_warned_no_op_on_cpu(
    tiny_config: Path, tmp_path: Path
):
    losses = {}
    for name, extra in (("plain", []), ("chunked", ["--kernels.chunk_loss_size=24"])):
        out = tmp_path / name
        run_train(
            tiny_config,
            [
                "--training.steps=2",
                f"--training.output_dir={out}",
                "--checkpoint.save_interleaved_steps=100",
                *extra,
            ],
            cwd=tmp_path,
        )
        losses[name] = [r["loss"] for r in read_metrics(out)]
    assert len(losses["plain"]) == 2
    assert losses["chunked"] == pytest.approx(losses["plain"], rel=1e-5)

    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshforge",
            "train",
            "--config",
            str(tiny_config),
            "--kernels.use_flash_attn=true",
            "--training.steps=1",
            f"--training.output_dir={tmp_path / 'flash'}",
            "--checkpoint.save_interleaved_steps=100",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert (
        "warning: kernels.use_flash_attn: true has no effect here: flash attention needs a CUDA device" in out
    )
    assert "Traceback" not in out


# ----------------------------------------------------------------------------- compile (slow)
@pytest.mark.procs  # inductor compiles its C++ kernels in processes
def test_compiled_decoder_layers_match_eager(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager, compiled = _qwen3(), _qwen3()
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    # Every decoder layer is compiled in place, and running them really goes through dynamo and
    # AOTAutograd (forward and backward graphs), which the eager twin never does.
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    assert eager.model.layers[0]._compiled_call_impl is None
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ids, labels = _batch(7)
    losses = []
    graphs = []
    for model in (eager, compiled):
        loss = cross_entropy_sum(model(ids), labels)
        loss.backward()
        losses.append(loss)
        graphs.append((counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]))
    assert graphs[0] == (0, 0) and graphs[1][0] >= 1 and graphs[1][1] >= 1, graphs
    assert_close(losses[1], losses[0], what="loss")
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert_close(b.grad, a.grad, rtol=1e-4, what=name)


def test_options_object_is_plain_data():
    opts = KernelOptions()
    assert opts.model_switches() == dict.fromkeys(
        (
            "use_flash_attn",
            "use_fused_rmsnorm",
            "use_fused_rotary_pos_emb",
            "moe_grouped_gemm",
            "fix_router",
            "pre_tokens",
        ),
        False,
    )


@pytest.mark.procs
def test_chunked_loss_under_fsdp_matches_one_process(tiny_config: Path, tmp_path: Path):
    """Two FSDP ranks with the chunked loss (lm_head read after the root forward) = one process."""
    losses = {}
    for name, nproc in (("fsdp2", 2), ("single", 1)):
        out = tmp_path / name
        train_one(
            tiny_config,
            [
                "--training.steps=3",
                f"--training.output_dir={out}",
                "--checkpoint.save_interleaved_steps=100",
                "--kernels.chunk_loss_size=24",
            ],
            nproc=nproc,
            cwd=tmp_path,
        )
        losses[name] = [r["loss"] for r in read_metrics(out)]
    assert losses["fsdp2"] == pytest.approx(losses["single"], rel=1e-5)


def test_gdn_chunk_size_reaches_qwen3_next_and_is_refused_elsewhere():
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.qwen3_next.gdn import GatedDeltaNet
    from meshforge.models.qwen3_next.model import build_qwen3_next

    assert _resolve().gdn_chunk_size is None  # not written: the layers keep their default
    opts = _resolve(gdn_chunk_size=16)
    assert opts.gdn_chunk_size == 16
    with pytest.raises(ValueError, match=r"^kernels.gdn_chunk_size: qwen3 has no Gated DeltaNet"):
        configure_model_kernels(_qwen3(), opts, family="qwen3")
    args = Qwen3NextArgs(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    model = build_qwen3_next(args)
    configure_model_kernels(model, opts, family="qwen3_next")
    chunks = {m.chunk_size for m in model.modules() if isinstance(m, GatedDeltaNet)}
    assert chunks == {16}
