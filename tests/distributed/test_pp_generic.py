"""Pipeline parallelism on the generic transformers path (2 gloo processes) equals one process.

Tiny ``transformers.Qwen3ForCausalLM`` folders (untied, and tied with a sliding-window layer so
a stage builds both of transformers' masks) are saved with ``save_pretrained`` and built through
meshforge's generic path (``GenericFamily.build`` -> ``wrap_generic``). One spawned launch runs
pp2 1f1b with an uneven split on packed documents (positions restart per document on every
stage) and pp2 gpipe on plain rows against the unsplit wrapper on the same weights: CE sums and
every parameter gradient within 1e-5 relative, over two AdamW steps. A ``meshforge train`` run
with ``--parallelism.pipeline_parallel=2`` on a tied generic folder (Mistral: a Qwen3 folder
would train through the built-in qwen3 family) logs the one-process losses and grad norms, and
its checkpoint resumes in one process. Unsupported model types and layouts are refused by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests._compare import assert_close
from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

WORLD = 2
VOCAB, SEQ, MB, N_MICRO = 64, 8, 2, 4
RTOL = 1e-5
QWEN3 = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
# (name, folder, schedule, layers_per_stage, packed)
CASES = [
    ("1f1b uneven untied packed", "untied", "1f1b", ["0", "1-2"], True),
    # Packed documents on a sliding layer: the window is kept inside each document (packed_masks).
    ("gpipe tied sliding layer packed", "tied", "gpipe", ["0-1", "2"], True),
    ("gpipe tied sliding layer", "tied", "gpipe", ["0-1", "2"], False),
]


def save_qwen3(folder: Path, *, tied: bool, sliding: bool = False, **overrides: object) -> Path:
    """A random tiny Qwen3ForCausalLM saved with save_pretrained (norm weights away from 1)."""
    extra: dict[str, object] = {"tie_word_embeddings": tied}
    if sliding:
        extra |= {
            "use_sliding_window": True,
            "sliding_window": 3,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        }
    torch.manual_seed(1 + tied)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, **extra, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def build_generic(folder: Path) -> torch.nn.Module:
    """The folder's model through meshforge's generic path, on cpu, with the saved weights."""
    from safetensors.torch import load_file

    from meshforge.models.generic.spec import generic_family

    config = json.loads((folder / "config.json").read_text())
    model = generic_family(folder, config, trust_remote_code=False).build({}, device="cpu")
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def micro_batches(packed: bool = True) -> list[dict[str, torch.Tensor]]:
    """Packed rows (two and three documents) and a padded row, or plain rows; some labels ignored."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N_MICRO):
        ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        labels[:, : i % 3] = -100
        seg = torch.tensor([[1] * 3 + [2] * 2 + [3] * (SEQ - 5), [1] * (SEQ - 2) + [0] * 2])
        out.append(
            {"input_ids": ids, "labels": labels, "segment_ids": seg}
            if packed
            else {"input_ids": ids, "labels": labels}
        )
    return out


def _reference(folder: Path, micro, steps: int = 2):
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    model = build_generic(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        for mb in micro:
            ce = cross_entropy_sum(model(mb["input_ids"], segment_ids=mb.get("segment_ids")), mb["labels"])
            (ce / tokens).backward()
            total += ce.detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        history.append((total, grads))
        opt.step()
    return history, tokens


def _run_case(rank: int, case, root: Path, pp_mesh) -> None:
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name, folder, schedule, spec, packed = case
    micro = micro_batches(packed)
    history, tokens = _reference(root / folder, micro)
    model = build_generic(root / folder)
    split = split_model(model, pp_rank=rank, pp_size=WORLD, layers_per_stage=spec, schedule=schedule)
    # Parameter names stay the whole model's (checkpoints move between layouts).
    hosted = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    assert hosted == {str(i) for s in split.stages for i in s.layers}, hosted
    assert split.tied_across_ranks == (folder == "tied")
    if split.tied_across_ranks and split.has_last:
        with torch.no_grad():  # build_pipeline must copy the embedding into the head copy
            model.lm_head.weight.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = build_pipeline(split, model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule=schedule)
    for step, (want_ce, want_grads) in enumerate(history):
        opt.zero_grad()
        ce = pipe.step(micro, tokens)
        assert_close(ce, want_ce, floor=1e-6, what=f"[{name}] step {step} CE sum on rank {rank}")
        for n, p in model.named_parameters():
            assert p.grad is not None, f"[{name}] {n} has no grad"
            # A tied head copy's gradient must be the one tied weight's (both uses summed).
            assert_close(
                p.grad, want_grads[n], floor=1e-6, what=f"[{name}] step {step} grad {n} on rank {rank}"
            )
        opt.step()


def _worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("pp",))
    for case in CASES:
        _run_case(rank, case, Path(root), mesh["pp"])


def test_pp2_generic_qwen3_equals_one_process(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    save_qwen3(tmp_path / "untied", tied=False)
    save_qwen3(tmp_path / "tied", tied=True, sliding=True)
    run_workers(_worker, WORLD, str(tmp_path))


def test_generic_refusals(tmp_path: Path) -> None:
    """Model types and layouts the stages cannot reproduce are refused by name."""
    from meshforge.models.generic.model import wrap_generic
    from meshforge.parallel.pipeline import split_model

    config = transformers.GemmaConfig(**{**QWEN3, "num_hidden_layers": 2})
    gemma = wrap_generic(transformers.GemmaForCausalLM._from_config(config, attn_implementation="sdpa"))
    with pytest.raises(NotImplementedError, match="model type 'gemma'"):
        split_model(gemma, pp_rank=0, pp_size=2)
    qwen = wrap_generic(
        transformers.Qwen3ForCausalLM._from_config(
            transformers.Qwen3Config(**QWEN3), attn_implementation="sdpa"
        )
    )
    rotary = qwen.model.rotary_emb
    del qwen.model.rotary_emb
    with pytest.raises(NotImplementedError, match=r"has no model\.rotary_emb"):
        split_model(qwen, pp_rank=0, pp_size=2)
    qwen.model.rotary_emb = rotary
    split_model(qwen, pp_rank=0, pp_size=2)
    with pytest.raises(ValueError, match="already split"):
        split_model(qwen, pp_rank=0, pp_size=2)


def test_train_pp2_generic_equals_one_process(tmp_path: Path) -> None:
    """``meshforge train`` with pipeline_parallel=2 on a generic folder logs the 1-process numbers.

    A Qwen3 folder would train through the built-in qwen3 family, so this one holds a Mistral
    model (no built-in family; 3 layers, split unevenly). The pp2 run's last checkpoint then
    resumes in one process and its next step equals the 1-process run's.
    """
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, _config

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    # Tied: the last rank loads its head copy from the embedding's key and keeps it equal.
    config_hf = transformers.MistralConfig(**{**MISTRAL, "num_hidden_layers": 3, "tie_word_embeddings": True})
    transformers.MistralForCausalLM(config_hf).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    config = _config(tmp_path, hf_dir)
    # 2 micro-batches of 2 rows per step (1f1b needs at least pp of them).
    common = ["--training.global_batch_size=4"]
    pp2 = [
        "--parallelism.pipeline_parallel=2",
        "--parallelism.pipeline_parallel_schedule=1f1b",
        '--parallelism.pipeline_parallel_layers_per_stage=["0", "1-2"]',
    ]
    runs = {}
    for name, nproc, args in (
        ("one", 1, ["--training.steps=4"]),
        ("pp2", 2, ["--training.steps=3", "--checkpoint.save_hf_weights=true", *pp2]),
        ("resumed", 1, ["--training.steps=4", f"--checkpoint.load_path={tmp_path / 'pp2' / 'checkpoints'}"]),
    ):
        out = tmp_path / name
        proc = train_one(config, [f"--training.output_dir={out}", *common, *args], nproc=nproc, cwd=tmp_path)
        assert "generic transformers path" in proc.stdout
        assert ("pipeline stage(s) 0 of 2" in proc.stdout) == (name == "pp2"), proc.stdout
        runs[name] = read_metrics(out)
    one, two, resumed = runs["one"], runs["pp2"], runs["resumed"]
    assert len(one) == 4 and len(two) == 3 and [m["step"] for m in resumed] == [4]
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one[:3]], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one[:3]], rel=1e-5)
    assert one[0]["loss"] != one[2]["loss"]  # it trains
    assert resumed[0]["loss"] == pytest.approx(one[3]["loss"], rel=1e-5)
    assert resumed[0]["grad_norm"] == pytest.approx(one[3]["grad_norm"], rel=1e-5)
    # The export (read back from the final checkpoint) is tied like the folder it came from.
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "pp2" / "hf" / "model.safetensors")
    assert exported.keys() == load_file(hf_dir / "model.safetensors").keys()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp2" / "hf")
