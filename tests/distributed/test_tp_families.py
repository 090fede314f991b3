"""Tensor-parallel plans of deepseek_v3, gpt_oss and qwen3_next equal one process, on 2 gloo ranks.

One spawn of 2 processes checks every case: each rank builds the full model from the same seed
(norm weights and other per-head parameters varied so that a wrong layout shows), keeps it as
the single-process reference and applies `apply_tp` to a deep copy. Forward logits, the loss
(router aux loss included where the family has one) and every parameter's gradient (gathered
with `full_tensor`, in its parameter's layout) must match the reference within 1e-5 of its norm,
or, for a gradient whose float32 rounding is larger than that on one process already (qwen3_next's
`dt_bias` and `A_log` sum terms that cancel), be no further from a float64 run than a few times
the float32 reference's own error (`tests._compare`),
with and without loss parallelism, sequence parallelism on and off, packed documents, tied and
untied embeddings. Then a few AdamW steps per family give the same losses, and the trainer's
meta-device build (TP applied before materialisation) gives the same model.

deepseek_v3: latent attention with and without the low-rank query path (and attention biases),
a dense layer then a sparse one. gpt_oss: a sliding-window layer then a full one, sinks split
with the heads. qwen3_next: Gated DeltaNet layers (heads split, conv channels and gated norm
kept whole) and a gated full-attention layer, dense and sparse feed-forwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests._compare import assert_close, assert_scalar_close
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

# Layer 0 dense (its MLP split), layer 1 sparse (router, shared and routed experts whole).
DEEPSEEK = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "tie_word_embeddings": False,
}
DEEPSEEK_FULL_Q = {**DEEPSEEK, "q_lora_rank": None, "attention_bias": True, "tie_word_embeddings": True}
# Layer 0 sliding-window attention (4 keys), layer 1 full attention; both sparse.
GPT_OSS = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "sliding_window": 4,
    "attention_bias": True,
    "output_router_logits": True,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
# Layer 0 Gated DeltaNet with a dense MLP, layer 1 gated full attention with a sparse block.
QWEN3_NEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [0],
    "output_router_logits": True,
    "tie_word_embeddings": False,
}
# Both layers linear attention, both sparse; tied embeddings.
QWEN3_NEXT_LINEAR = {
    **QWEN3_NEXT,
    "layer_types": ["linear_attention", "linear_attention"],
    "mlp_only_layers": [],
    "tie_word_embeddings": True,
}
# (name, family, options, apply_tp keyword arguments, packed segment ids)
CASES = [
    ("deepseek_v3", "deepseek_v3", DEEPSEEK, {}, False),
    ("deepseek_v3 packed loss-parallel", "deepseek_v3", DEEPSEEK, {"loss_parallel": True}, True),
    ("deepseek_v3 q_proj bias tied", "deepseek_v3", DEEPSEEK_FULL_Q, {}, False),
    ("deepseek_v3 q_proj tied loss-parallel", "deepseek_v3", DEEPSEEK_FULL_Q, {"loss_parallel": True}, True),
    ("deepseek_v3 no SP", "deepseek_v3", DEEPSEEK, {"sequence_parallel": False}, False),
    ("gpt_oss tied", "gpt_oss", GPT_OSS, {}, False),
    ("gpt_oss tied packed loss-parallel", "gpt_oss", GPT_OSS, {"loss_parallel": True}, True),
    (
        "gpt_oss untied loss-parallel",
        "gpt_oss",
        {**GPT_OSS, "tie_word_embeddings": False},
        {"loss_parallel": True},
        False,
    ),
    ("gpt_oss no SP", "gpt_oss", GPT_OSS, {"sequence_parallel": False}, True),
    ("qwen3_next", "qwen3_next", QWEN3_NEXT, {}, False),
    ("qwen3_next packed loss-parallel", "qwen3_next", QWEN3_NEXT, {"loss_parallel": True}, True),
    ("qwen3_next linear tied packed", "qwen3_next", QWEN3_NEXT_LINEAR, {}, True),
    ("qwen3_next no SP", "qwen3_next", QWEN3_NEXT, {"sequence_parallel": False}, True),
]
# (family, options) trained a few AdamW steps, and built on meta like the trainer does.
TRAIN = [("deepseek_v3", DEEPSEEK), ("gpt_oss", GPT_OSS), ("qwen3_next", QWEN3_NEXT)]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(vocab: int, packed: bool, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    labels = torch.randint(0, vocab, (2, 16), generator=g)
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["segment_ids"] = torch.tensor([[1] * 6 + [2] * 10, [1] * 9 + [2] * 5 + [0] * 2])
    return batch


def _vary(model: torch.nn.Module) -> None:
    """Norm weights start at 1 (or 0), biases at 0: vary them so a wrong gradient or layout shows."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _small_chunks(model: torch.nn.Module) -> None:
    """Gated DeltaNet in chunks of 4 tokens, so the state is carried across chunks (kernels.gdn_chunk_size)."""
    for module in model.modules():
        if hasattr(module, "chunk_size") and hasattr(module, "A_log"):
            module.chunk_size = 4


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
    loss = cross_entropy_sum(logits, batch["labels"]) / count_valid_tokens(batch["labels"])
    assert not hasattr(loss, "placements"), "cross_entropy_sum must return a plain tensor"
    aux = model.aux_loss() if hasattr(model, "aux_loss") else None
    if aux is not None:
        # The router statistics must be those of all tokens, so the aux loss equals one process's.
        loss = loss + 0.5 * aux
    return logits, loss


def _compare(
    case: str,
    ref: torch.nn.Module,
    ref64: torch.nn.Module,
    tp: torch.nn.Module,
    batch: dict[str, torch.Tensor],
) -> None:
    ref_logits, ref_loss = _loss(ref, batch)
    ref_loss.backward()
    logits64, loss64 = _loss(ref64, batch)
    loss64.backward()
    logits, loss = _loss(tp, batch)
    loss.backward()
    assert_close(logits, ref_logits, want64=logits64, what=(case, "logits"))
    assert_close(loss, ref_loss, want64=loss64, what=(case, "loss"))
    if hasattr(ref, "tokens_per_expert"):
        counts, ref_counts = tp.tokens_per_expert(), ref.tokens_per_expert()
        assert counts.keys() == ref_counts.keys() and counts, (case, "expert counts")
        for layer, value in counts.items():
            assert torch.equal(value, ref_counts[layer]), (case, "expert counts", layer)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads64 = {n: p.grad for n, p in ref64.named_parameters()}
    # Every parameter is a DTensor on the TP mesh (the fused optimizer refuses a mix).
    plain = [n for n, p in tp.named_parameters() if not hasattr(p, "placements")]
    assert not plain, (case, "plain parameters", plain)
    assert [n for n, _ in tp.named_parameters()] == list(ref_grads), (case, "parameter names changed")
    for name, p in tp.named_parameters():
        if not p.requires_grad:  # DeepSeek's frozen correction bias
            assert p.grad is None and ref_grads[name] is None, (case, name)
            continue
        assert p.grad is not None, (case, name)
        # Each gradient is in its parameter's layout, so its local part is this rank's slice.
        assert p.grad.placements == p.placements, (case, name, p.grad.placements, p.placements)
        assert_close(p.grad, ref_grads[name], want64=grads64[name], what=(case, name))


def _check_case(mesh, case: str, family: str, options: dict, kwargs: dict, packed: bool) -> None:
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    ref = resolve_family(family).build(options, device="cpu")
    _vary(ref)
    _small_chunks(ref)
    tp = copy.deepcopy(ref)
    # The same model in float64: what the float32 runs round away from.
    ref64 = copy.deepcopy(ref).to(torch.float64)
    apply_tp(tp, mesh, family=family, **kwargs)
    # Compiled TP graphs are rank-specific; the AOTAutograd cache would share them across ranks
    # (pytorch/pytorch#188390: measured 5-80% wrong gradients with kernels.compile).
    assert not torch._functorch.config.enable_autograd_cache, case
    if options["tie_word_embeddings"]:
        assert tp.lm_head.weight is tp.model.embed_tokens.weight, case
    _compare(case, ref, ref64, tp, _batch(options["vocab_size"], packed))


def _check_training(mesh, family: str, options: dict) -> None:
    """Three AdamW steps (SP, loss parallel) give the losses of one process; so does a meta build."""
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    spec = resolve_family(family)
    ref, tp = spec.build(options), spec.build(options)
    # The trainer's order: build on meta, apply TP, then materialise each parameter from the seed.
    apply_tp(tp, mesh, family=family, loss_parallel=True)
    for model in (ref, tp):
        materialize_and_init(model, device=torch.device("cpu"), seed=5, init_fn=model.init_full_parameter_)
        _small_chunks(model)
    for name, p in tp.named_parameters():
        assert torch.equal(_full(p.detach()), ref.get_parameter(name).detach()), (family, "meta build", name)
    optims = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for m in (ref, tp)
    ]
    for step in range(3):
        batch = _batch(options["vocab_size"], packed=step == 1, seed=step)
        losses = []
        for model, optim in zip((ref, tp), optims, strict=True):
            optim.zero_grad()
            _, loss = _loss(model, batch)
            loss.backward()
            optim.step()
            losses.append(loss.item())
        assert_scalar_close(losses[1], losses[0], what=(family, "AdamW step", step))


def _check_refusals(mesh) -> None:
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    deepseek = resolve_family("deepseek_v3")
    with pytest.raises(
        ValueError, match=r"model\.num_attention_heads \(3\) .*parallelism\.tensor_parallel \(2\)"
    ):
        apply_tp(
            deepseek.build({**DEEPSEEK, "num_attention_heads": 3, "num_key_value_heads": 3}),
            mesh,
            family="deepseek_v3",
        )
    with pytest.raises(ValueError, match=r"model\.intermediate_size \(63\)"):
        apply_tp(deepseek.build({**DEEPSEEK, "intermediate_size": 63}), mesh, family="deepseek_v3")
    with pytest.raises(ValueError, match=r"model\.linear_num_key_heads \(1\) .*parallelism\.tensor_parallel"):
        apply_tp(
            resolve_family("qwen3_next").build({**QWEN3_NEXT, "linear_num_key_heads": 1}),
            mesh,
            family="qwen3_next",
        )
    with pytest.raises(ValueError, match=r"model\.num_key_value_heads \(1\)"):
        apply_tp(
            resolve_family("gpt_oss").build({**GPT_OSS, "num_key_value_heads": 1}), mesh, family="gpt_oss"
        )
    # All layers sparse: the dense intermediate size is not split, so it need not divide.
    apply_tp(
        deepseek.build({**DEEPSEEK, "intermediate_size": 63, "first_k_dense_replace": 0}),
        mesh,
        family="deepseek_v3",
    )


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for case, family, options, kwargs, packed in CASES:
        _check_case(mesh, case, family, options, kwargs, packed)
    for family, options in TRAIN:
        _check_training(mesh, family, options)
    _check_refusals(mesh)


def test_tp2_families_equal_one_process() -> None:
    run_workers(_worker, 2)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_next"])
def test_trainer_tp2_equals_one_process(family: str, tmp_path: Path) -> None:
    """A trainer run with tensor_parallel=2 on unpacked text rows (RoPE over the whole row while
    the hidden states hold half of it) logs the one-process loss and grad norm."""
    from tests.conftest import read_metrics, write_corpus
    from tests.distributed._layouts import Run, train_all

    config = Path(__file__).resolve().parents[2] / "configs" / family / "tiny.yaml"
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=40)
    common = [
        "--training.steps=3",
        "--checkpoint.enable_save=false",
        f"--train_dataset.dataloader.data_path={corpus}",
        "--train_dataset.dataloader.seq_length=32",
    ]
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    train_all(
        [
            Run(config, [*common, f"--training.output_dir={one}"]),
            Run(
                config, [*common, "--parallelism.tensor_parallel=2", f"--training.output_dir={tp2}"], nproc=2
            ),
        ]
    )
    want, got = read_metrics(one), read_metrics(tp2)
    assert len(want) == len(got) == 3
    for a, b in zip(want, got, strict=True):
        assert_scalar_close(b["loss"], a["loss"], what=(family, a["step"], "loss"))
        assert_scalar_close(b["grad_norm"], a["grad_norm"], what=(family, a["step"], "grad_norm"))
