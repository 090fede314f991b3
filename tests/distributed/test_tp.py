"""Tensor parallelism (with sequence and loss parallelism) equals one process, on 2 gloo ranks.

One spawn of 2 processes checks every layout: each rank builds the full model from the same seed,
keeps it as the single-process reference, and applies `apply_tp` to a deep copy. Forward logits,
the loss and every parameter's gradient (gathered with `full_tensor`, and laid out like its
parameter) must match the reference: qwen3 (GQA, per-head q/k norms) untied and tied, llama with
biases, qwen3_moe (experts kept whole on every rank, router aux loss included), with and without
loss parallelism, packed documents, no sequence parallelism, the meta-device build the trainer
uses (materialised afterwards), compiled layers, and the generic transformers path driven by the
`tp_colwise` / `tp_rowwise` patterns (tied embeddings too). The refusals (divisibility,
unsupported family, sequence length, chunked loss) run in the same launch. A second test runs
`meshforge train` with tensor_parallel=2 against one process and resumes its checkpoint on one;
a third trains a transformers Qwen3 folder through the generic path under TP.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests._compare import rel_error
from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

TOL = 1e-5
QWEN3 = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": False,
}
LLAMA = {**QWEN3, "attention_bias": True, "mlp_bias": True}
# Layer 0 dense (its MLP split), layer 1 sparse (router and experts kept whole on every rank).
QWEN3_MOE = {
    **QWEN3,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "mlp_only_layers": [0],
    "output_router_logits": True,
}
# (name, family, options, apply_tp keyword arguments, use packed segment ids)
CASES = [
    ("qwen3", "qwen3", QWEN3, {}, False),
    ("qwen3 loss-parallel", "qwen3", QWEN3, {"loss_parallel": True}, False),
    ("qwen3 tied", "qwen3", {**QWEN3, "tie_word_embeddings": True}, {}, False),
    (
        "qwen3 tied loss-parallel",
        "qwen3",
        {**QWEN3, "tie_word_embeddings": True},
        {"loss_parallel": True},
        False,
    ),
    ("qwen3 packed", "qwen3", QWEN3, {"loss_parallel": True}, True),
    ("qwen3 no SP", "qwen3", QWEN3, {"sequence_parallel": False}, False),
    ("llama bias", "llama", LLAMA, {}, False),
    ("llama bias loss-parallel", "llama", LLAMA, {"loss_parallel": True}, False),
    ("qwen3_moe packed loss-parallel", "qwen3_moe", QWEN3_MOE, {"loss_parallel": True}, True),
    ("qwen3_moe no SP", "qwen3_moe", QWEN3_MOE, {"sequence_parallel": False}, False),
]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(vocab: int, packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    labels = torch.randint(0, vocab, (2, 16), generator=g)
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["segment_ids"] = torch.tensor([[1] * 6 + [2] * 10, [1] * 9 + [2] * 5 + [0] * 2])
    return batch


def _randomise_norms(model: torch.nn.Module) -> None:
    # Norm weights start at 1; vary them so that a wrong norm gradient or layout shows.
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
    loss = cross_entropy_sum(logits, batch["labels"]) / count_valid_tokens(batch["labels"])
    assert not hasattr(loss, "placements"), "cross_entropy_sum must return a plain tensor"
    aux = model.aux_loss() if hasattr(model, "aux_loss") else None
    if aux is not None:
        # The router statistics must be those of all tokens, so the aux loss equals one process's.
        loss = loss + 0.5 * aux
    loss.backward()
    return _full(logits.detach()), loss.detach()


def _compare(case: str, ref: torch.nn.Module, tp: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    ref_logits, ref_loss = _step(ref, batch)
    logits, loss = _step(tp, batch)
    assert rel_error(logits, ref_logits) <= TOL, (case, "logits", rel_error(logits, ref_logits))
    assert rel_error(loss, ref_loss) <= TOL, (case, "loss", loss.item(), ref_loss.item())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    # Every parameter is a DTensor on the TP mesh (the fused optimizer refuses a mix).
    plain = [n for n, p in tp.named_parameters() if not hasattr(p, "placements")]
    assert not plain, (case, "plain parameters", plain)
    names = [n for n, _ in tp.named_parameters()]
    assert names == list(ref_grads), (case, "parameter names changed")
    for name, p in tp.named_parameters():
        assert p.grad is not None, (case, name)
        # Each gradient is in its parameter's layout, so its local part is this rank's slice.
        assert getattr(p.grad, "placements", None) == getattr(p, "placements", None), (case, name)
        err = rel_error(_full(p.grad), ref_grads[name])
        assert err <= TOL, (case, name, err)


def _check_builtin(mesh, family_name: str, options: dict, kwargs: dict, packed: bool, case: str) -> None:
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    ref = resolve_family(family_name).build(options, device="cpu")
    _randomise_norms(ref)
    tp = copy.deepcopy(ref)
    apply_tp(tp, mesh, family=family_name, **kwargs)
    if options["tie_word_embeddings"]:
        assert tp.lm_head.weight is tp.model.embed_tokens.weight, case
        assert tp.lm_head.weight.placements == (torch.distributed.tensor.Shard(0),), case
    _compare(case, ref, tp, _batch(options["vocab_size"], packed))


def _check_compiled_layers(mesh) -> None:
    """`kernels.compile` (each decoder layer compiled after TP) gives the same logits and gradients."""
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    ref = resolve_family("qwen3").build(QWEN3, device="cpu")
    _randomise_norms(ref)
    tp = copy.deepcopy(ref)
    apply_tp(tp, mesh, family="qwen3", loss_parallel=True)
    for layer in tp.model.layers:
        layer.compile()
    _compare("compiled layers", ref, tp, _batch(QWEN3["vocab_size"], False))


def _check_meta_build(mesh) -> None:
    """The trainer's order: build on meta, apply TP, then materialise each parameter from the seed."""
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    options = {**QWEN3, "tie_word_embeddings": True}
    family = resolve_family("qwen3")
    ref, tp = family.build(options), family.build(options)
    apply_tp(tp, mesh, family="qwen3", loss_parallel=True)
    for model in (ref, tp):
        materialize_and_init(model, device=torch.device("cpu"), seed=5, init_fn=model.init_full_parameter_)
    assert tp.lm_head.weight is tp.model.embed_tokens.weight
    _compare("meta build", ref, tp, _batch(options["vocab_size"], False))


def _check_generic(mesh) -> None:
    """transformers' Qwen3 (per-head q/k norms, GQA) through the pattern-driven plan."""
    import transformers

    from meshforge.models.generic.model import wrap_generic
    from meshforge.models.generic.spec import FAMILY as GENERIC
    from meshforge.parallel.config import MS_TP_COLWISE, MS_TP_ROWWISE
    from meshforge.parallel.tensor import apply_tp

    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    ref = wrap_generic(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    _randomise_norms(ref)
    for kwargs, case in (
        ({"colwise": list(MS_TP_COLWISE), "rowwise": list(MS_TP_ROWWISE)}, "generic patterns"),
        (
            {
                "colwise": [*MS_TP_COLWISE, "lm_head"],
                "rowwise": [*MS_TP_ROWWISE, "model.embed_tokens"],
                "loss_parallel": True,
            },
            "generic patterns, vocab-split embedding and head, loss-parallel",
        ),
    ):
        ref.zero_grad(set_to_none=True)
        tp = copy.deepcopy(ref)
        apply_tp(tp, mesh, family=GENERIC, **kwargs)
        assert type(tp.model.layers[0].self_attn.q_norm.weight).__name__ == "DTensor"
        _compare(case, ref, tp, _batch(128, packed=True))

    # Tied embeddings: split both ends of the vocabulary alike (one parameter), or it is refused.
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    ref = wrap_generic(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    tp = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="lm_head.weight is tied to model.embed_tokens.weight"):
        apply_tp(copy.deepcopy(ref), mesh, family=GENERIC, colwise=["lm_head"], rowwise=[])
    apply_tp(
        tp,
        mesh,
        family=GENERIC,
        colwise=[*MS_TP_COLWISE, "lm_head"],
        rowwise=[*MS_TP_ROWWISE, "model.embed_tokens"],
        loss_parallel=True,
    )
    assert tp.lm_head.weight is tp.model.embed_tokens.weight
    _compare("generic tied, vocab split", ref, tp, _batch(128, packed=False))


def _check_refusals(mesh) -> None:
    from meshforge.loss.cross_entropy import chunked_cross_entropy_sum
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    family = resolve_family("qwen3")
    with pytest.raises(
        ValueError, match=r"model\.num_key_value_heads \(1\) .*parallelism\.tensor_parallel \(2\)"
    ):
        apply_tp(family.build({**QWEN3, "num_key_value_heads": 1}), mesh, family="qwen3")
    with pytest.raises(ValueError, match=r"model\.vocab_size \(127\)"):
        apply_tp(family.build({**QWEN3, "vocab_size": 127}), mesh, family="qwen3")
    with pytest.raises(
        NotImplementedError, match="not supported yet: parallelism.tensor_parallel > 1 for family 'mamba'"
    ):
        apply_tp(family.build(QWEN3), mesh, family="mamba")
    with pytest.raises(ValueError, match=r"parallelism\.tp_colwise: .*generic transformers path only"):
        apply_tp(family.build(QWEN3), mesh, family="qwen3", colwise=["*.q_proj"])
    model = family.build(QWEN3, device="cpu")
    apply_tp(model, mesh, family="qwen3")
    with pytest.raises(ValueError, match=r"sequence length \(15\) must be a multiple of 2"):
        model(torch.zeros(1, 15, dtype=torch.long))
    hidden = model(torch.zeros(1, 16, dtype=torch.long), return_hidden=True)
    # The chunked loss takes the sequence-sharded hidden states and vocab-sharded head as they
    # are (it gathers them): the loss of the gathered tensors.
    labels = torch.zeros(1, 16, dtype=torch.long)
    got = chunked_cross_entropy_sum(hidden, model.lm_head.weight, labels, chunk_size=4)
    want = chunked_cross_entropy_sum(
        hidden.full_tensor(), model.lm_head.weight.full_tensor(), labels, chunk_size=4
    )
    torch.testing.assert_close(got, want)


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for case, family_name, options, kwargs, packed in CASES:
        _check_builtin(mesh, family_name, options, kwargs, packed, case)
    _check_meta_build(mesh)
    _check_compiled_layers(mesh)
    _check_generic(mesh)
    _check_refusals(mesh)


def test_tp2_equals_one_process() -> None:
    run_workers(_worker, 2)


def test_trainer_tp2_equals_one_process_and_resumes_on_one(tiny_config: Path, tmp_path: Path) -> None:
    """`meshforge train` with tensor_parallel=2 (SP, loss parallel, tied embeddings) = 1 process.

    Its step-2 checkpoint (DTensor shards over the TP mesh) then continues in one process with
    the same losses.
    """
    common = ["--training.steps=5"]
    one, tp2, moved = tmp_path / "one", tmp_path / "tp2", tmp_path / "moved"
    # The chunked loss (kernels.chunk_loss_size) under TP: the sharded hidden states and head
    # are gathered; the same numbers as one process with the chunked loss.
    chunk_one, chunk_tp2 = tmp_path / "chunk_one", tmp_path / "chunk_tp2"
    chunked = [*common, "--kernels.chunk_loss_size=8", "--checkpoint.enable_save=false"]
    step2 = tp2 / "checkpoints" / "checkpoint-00000002"
    resume = [*common, f"--training.output_dir={moved}", f"--checkpoint.load_path={step2}"]
    tp_args = ["--parallelism.tensor_parallel=2", "--parallelism.enable_loss_parallel=true"]
    # The one-process runs here, both tp2 runs in one spawn, then the resumed run here.
    train_all(
        [
            Run(tiny_config, [*common, f"--training.output_dir={one}", "--checkpoint.enable_save=false"]),
            Run(tiny_config, [*chunked, f"--training.output_dir={chunk_one}"]),
            Run(
                tiny_config, [*common, f"--training.output_dir={tp2}", *tp_args], 2, log=tmp_path / "tp2.log"
            ),
            Run(
                tiny_config,
                [*chunked, f"--training.output_dir={chunk_tp2}", "--parallelism.tensor_parallel=2"],
                2,
            ),
            Run(tiny_config, [*resume, "--checkpoint.enable_save=false"]),
        ]
    )
    assert "TP+SP over 2 ranks" in (tmp_path / "tp2.log").read_text()
    a, b = read_metrics(one), read_metrics(tp2)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (
            x["step"],
            x["grad_norm"],
            y["grad_norm"],
        )

    for x, y in zip(read_metrics(chunk_one), read_metrics(chunk_tp2), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), ("chunked", x["step"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), ("chunked", x["step"])

    c = read_metrics(moved)
    assert [r["step"] for r in c] == [3, 4, 5]
    for x, y in zip(a[2:], c, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])


def test_trainer_generic_tp2_equals_one_process(tmp_path: Path) -> None:
    """The generic transformers path (a local Mistral folder) trains under TP by the default patterns."""
    transformers = pytest.importorskip("transformers")
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, _config

    # Mistral: no built-in family, so it trains through the generic path (a Qwen3 folder would
    # take the built-in qwen3 plan).
    folder = tmp_path / "hf_mistral"
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**MISTRAL)).save_pretrained(folder)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(folder)
    cfg = _config(tmp_path, folder, "checkpoint:\n  enable_save: false")

    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    train_all(
        [
            Run(cfg, [f"--training.output_dir={one}"]),
            Run(
                cfg,
                [f"--training.output_dir={tp2}", "--parallelism.tensor_parallel=2"],
                2,
                log=tmp_path / "tp2.log",
            ),
        ]
    )
    assert "generic transformers path" in (tmp_path / "tp2.log").read_text()
    a, b = read_metrics(one), read_metrics(tp2)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (
            x["step"],
            x["grad_norm"],
            y["grad_norm"],
        )
