"""Context parallelism on the generic transformers path equals one process (gloo, 2 ranks).

One 2-process launch: tiny transformers models (Qwen3 with grouped K/V heads, Qwen3 with a
sliding-window layer, Mistral with a window on every layer, Llama with grouped and with a single
K/V head) are saved with ``save_pretrained``, built through meshforge's generic family and
wrapper, and run under ``apply_cp`` with ulysses, colossal (ring) and kvallgather, with and
without packed documents: the loss and every parameter gradient (summed over the CP ranks) equal
the single-process wrapped model's within 1e-5 relative. The refusals (attention dropout, a call
outside meshforge's forward, a pipeline stage, a window the attention never sees, heads that do
not divide) are checked in the same launch. A single-process check pins the reference itself:
each document of a packed row of a sliding-window model gives the logits it gives alone. Then
``meshforge train`` on the generic path (a Mistral folder, no built-in family) with
``--parallelism.context_parallel=2`` (ulysses and colossal) logs the one-process losses and grad
norms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._compare import assert_close, rel_error
from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

SEQ = 16
TOL = 1e-5
COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
MODELS = {
    "qwen3": ("Qwen3", {"num_key_value_heads": 2}),
    # Layer 1 is a sliding-window layer (window 5 < the CP chunk boundaries it crosses).
    "qwen3_sliding": (
        "Qwen3",
        {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    # No layer_types: the window applies to every layer (Mistral-style).
    "mistral_sliding": ("Mistral", {"num_key_value_heads": 2, "sliding_window": 5}),
    "llama": ("Llama", {"num_key_value_heads": 2}),
    "llama_mqa": ("Llama", {"num_key_value_heads": 1}),
}


def _save_models(root: Path) -> None:
    for name, (arch, extra) in MODELS.items():
        torch.manual_seed(0)
        config = getattr(transformers, f"{arch}Config")(**COMMON, **extra)
        model = getattr(transformers, f"{arch}ForCausalLM")(config)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)  # non-trivial norm weights: their gradients differ
        model.save_pretrained(root / name)


def _build(folder: Path) -> torch.nn.Module:
    """The model as meshforge's generic path builds it (family, SDPA, wrapper), with the saved weights."""
    import json

    from safetensors.torch import load_file

    from meshforge.models.generic.spec import generic_family

    hf_config = json.loads((folder / "config.json").read_text())
    model = generic_family(folder, hf_config, trust_remote_code=False).build({}, device="cpu")
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return model


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    batch = {
        "input_ids": torch.randint(0, 64, (2, SEQ), generator=g),
        "labels": torch.randint(0, 64, (2, SEQ), generator=g),
    }
    if packed:
        # Documents cut across the CP chunks; row 1 ends in padding (segment 0, no loss).
        seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 5 + [0] * 2])
        batch["segment_ids"] = seg
        batch["labels"] = batch["labels"].masked_fill(seg == 0, -100)
    return batch


def _check_equal(folder: Path, method: str, mesh, *, packed: bool, chunks: int = 1) -> None:
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.parallel.chunk_batch import apply_chunk_batch
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    ref, model = _build(folder), _build(folder)
    apply_cp(model, mesh, method=method)
    if chunks > 1:
        # parallelism.enable_chunk_batch: each layer runs row by row; the CP state is cut by rows.
        apply_chunk_batch(model, chunks=chunks, modules=["model.layers.{*}"])
    batch = _batch(packed)
    tokens = (batch["labels"] != -100).sum()

    ref_loss = cross_entropy_sum(
        ref(batch["input_ids"], segment_ids=batch.get("segment_ids")), batch["labels"]
    )
    (ref_loss / tokens).backward()

    local = shard_batch_for_cp(batch, mesh, method=method)
    logits = model(
        local["input_ids"], position_ids=local["position_ids"], segment_ids=local.get("segment_ids")
    )
    assert logits.shape[:2] == (2, SEQ // mesh.size())
    loss = cross_entropy_sum(logits, local["labels"])
    (loss / tokens).backward()

    what = f"{folder.name} {method} packed={packed} chunks={chunks}"
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    assert rel_error(total, ref_loss.detach()) <= TOL, (what, total, ref_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert rel_error(grad, q.grad) <= TOL, (what, name, rel_error(grad, q.grad))


def _check_errors(root: Path, mesh) -> None:
    from meshforge.parallel.context import apply_cp

    model = _build(root / "qwen3")
    model.config.attention_dropout = 0.1
    with pytest.raises(NotImplementedError, match=r"attention_dropout 0\.1.*generic transformers path"):
        apply_cp(model, mesh, method="ulysses")
    model = _build(root / "qwen3")
    apply_cp(model, mesh, method="colossal")
    # transformers' own calling convention bypasses the CP state: refused, not a local-only attention.
    with pytest.raises(RuntimeError, match="runs only inside meshforge's forward"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))
    # A configured window the attention calls never see (Llama passes none): refused, not dropped.
    model = _build(root / "llama")
    model.config.sliding_window = 4
    apply_cp(model, mesh, method="ulysses")
    with pytest.raises(NotImplementedError, match=r"sliding_window 4 .*pass no sliding_window"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model = _build(root / "qwen3")
    model.config.num_attention_heads = 3
    with pytest.raises(ValueError, match=r"num_attention_heads must divide by 2"):
        apply_cp(model, mesh, method="ulysses")


def _worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    folders = Path(root)
    for method in ("ulysses", "colossal", "kvallgather"):
        for packed in (False, True):
            _check_equal(folders / "qwen3", method, mesh, packed=packed)
            _check_equal(folders / "qwen3_sliding", method, mesh, packed=packed)
    _check_equal(folders / "mistral_sliding", "colossal", mesh, packed=True)
    _check_equal(folders / "llama", "colossal", mesh, packed=True)
    _check_equal(folders / "llama_mqa", "ulysses", mesh, packed=True)
    for method in ("ulysses", "colossal"):
        _check_equal(folders / "qwen3_sliding", method, mesh, packed=True, chunks=2)
    _check_errors(folders, mesh)


def test_generic_cp_two_ranks_equal_one_process(tmp_path: Path) -> None:
    _save_models(tmp_path)
    run_workers(_worker, 2, str(tmp_path), timeout=180)


def test_generic_train_cp2_equals_one_process(tmp_path: Path) -> None:
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, _config

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**MISTRAL)).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    config = _config(tmp_path, hf_dir)
    common = ["--checkpoint.enable_save=false"]
    train_one(config, [*common, f"--training.output_dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = read_metrics(tmp_path / "one")
    assert len(one) == 3
    # colossal also runs each decoder layer on one row at a time (chunked micro-batches: the CP
    # state is cut by rows and its call counts add up in the whole batch's state).
    chunked = {
        "ulysses": [],
        "colossal": ["--parallelism.enable_chunk_batch=true", "--parallelism.chunk_mbs=2"],
    }
    for method in ("ulysses", "colossal"):
        out = tmp_path / method
        proc = train_one(
            config,
            [
                *common,
                *chunked[method],
                f"--training.output_dir={out}",
                "--parallelism.context_parallel=2",
                f"--parallelism.context_parallel_method={method}",
            ],
            nproc=2,
            cwd=tmp_path,
        )
        assert "generic transformers path" in proc.stdout and f"CP ({method}) over 2 ranks" in proc.stdout
        for x, y in zip(one, read_metrics(out), strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), method
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), method


@pytest.mark.parametrize("name", ["qwen3_sliding", "mistral_sliding"])
def test_generic_packed_rows_keep_the_sliding_window(tmp_path: Path, name: str) -> None:
    # The one-process reference itself: each document of a packed row gives the logits it
    # gives alone (positions restart, the window reaches back inside the document only).
    arch, extra = MODELS[name]
    torch.manual_seed(0)
    getattr(transformers, f"{arch}ForCausalLM")(
        getattr(transformers, f"{arch}Config")(**COMMON, **extra)
    ).save_pretrained(tmp_path / name)
    model = _build(tmp_path / name)
    batch = _batch(packed=True)
    with torch.no_grad():
        packed = model(batch["input_ids"], segment_ids=batch["segment_ids"])
        for row in range(2):
            segments = batch["segment_ids"][row]
            for doc in segments.unique().tolist():
                if doc == 0:
                    continue
                where = (segments == doc).nonzero().flatten()
                alone = model(batch["input_ids"][row : row + 1, where])
                assert_close(packed[row, where], alone[0], what=(row, where))
