"""Pipeline x context parallelism on the generic transformers path (4 processes) equals one process.

``meshforge train`` on a generic Mistral folder (no built-in family; 3 layers, a sliding window
shorter than the rows so it crosses the CP chunk boundaries, tied embeddings so the head copy on
the last stage is kept equal) with ``--parallelism.pipeline_parallel=2`` and
``--parallelism.context_parallel=2``: each pipeline stage builds the per-forward CP state and the
global positions itself (the wrapper's forward does it in one process) and hands the state to its
transformers layers. Colossal (ring) with 1f1b and ulysses with gpipe, an uneven explicit layer
split, 3 steps: the logged loss and grad norm equal the one-process run's within 1e-5 relative.

A spawned 4-process launch (pp2 x cp2 mesh) checks the stages directly on packed documents cut
across the CP chunks: ``split_model`` -> ``apply_cp`` -> ``build_pipeline`` against the unsplit
wrapper, the CE sum and every parameter gradient (summed over the CP ranks) within 1e-5
relative; a Qwen3 folder whose first stage holds only full-attention layers of a model with a
sliding one (that stage's attention rightly gets no window).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._compare import assert_close
from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

# (method, schedule) per 4-process launch.
LAYOUTS = [("colossal", "1f1b"), ("ulysses", "gpipe")]

SEQ, MB, N_MICRO, VOCAB = 16, 2, 2, 64
RTOL = 1e-5
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
FOLDERS = {
    # Every layer windowed (Mistral-style, no layer_types); tied: the head copy on the last stage.
    "mistral": ("Mistral", {"sliding_window": 5, "tie_word_embeddings": True}),
    # layer_types [full, full, sliding]: split ["0-1", "2"], the first stage has no sliding layer.
    "qwen3": (
        "Qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 2,
            "tie_word_embeddings": False,
        },
    ),
}
# (folder, method, schedule, layers_per_stage, packed)
CASES = [
    ("mistral", "colossal", "1f1b", ["0", "1-2"], True),
    ("qwen3", "ulysses", "gpipe", ["0-1", "2"], True),
    ("mistral", "kvallgather", "gpipe", ["0-1", "2"], False),
]


def _save(root: Path) -> None:
    for name, (arch, extra) in FOLDERS.items():
        torch.manual_seed(0)
        model = getattr(transformers, f"{arch}ForCausalLM")(
            getattr(transformers, f"{arch}Config")(**COMMON, **extra)
        )
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)  # non-trivial norm weights: their gradients differ
        model.save_pretrained(root / name)


def _build(folder: Path) -> torch.nn.Module:
    """The folder's model as meshforge's generic path builds it, with the saved weights."""
    from safetensors.torch import load_file

    from meshforge.models.generic.spec import generic_family

    hf_config = json.loads((folder / "config.json").read_text())
    model = generic_family(folder, hf_config, trust_remote_code=False).build({}, device="cpu")
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def _micro(packed: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(N_MICRO):
        mb = {
            "input_ids": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
        }
        if packed:
            # Documents cut across the CP chunks; row 1 ends in padding (no loss there).
            seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 5 + [0] * 2])
            mb["segment_ids"] = seg
            mb["labels"] = mb["labels"].masked_fill(seg == 0, -100)
        out.append(mb)
    return out


def _run_case(case, root: Path, pp_mesh, cp_mesh) -> None:
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp
    from meshforge.parallel.pipeline import build_pipeline, split_model

    folder, method, schedule, spec, packed = case
    micro = _micro(packed)
    tokens = sum((mb["labels"] != -100).sum() for mb in micro)
    ref = _build(root / folder)
    want = torch.zeros(())
    for mb in micro:
        ce = cross_entropy_sum(ref(mb["input_ids"], segment_ids=mb.get("segment_ids")), mb["labels"])
        (ce / tokens).backward()
        want += ce.detach()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}

    model = _build(root / folder)
    split = split_model(
        model, pp_rank=pp_mesh.get_local_rank(), pp_size=2, layers_per_stage=spec, schedule=schedule
    )
    apply_cp(split.model, cp_mesh, method=method)
    pipe = build_pipeline(
        split, split.model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule=schedule
    )
    local = [shard_batch_for_cp(mb, cp_mesh, method=method) for mb in micro]
    assert local[0]["input_ids"].shape == (MB, SEQ // 2)
    got = pipe.step(local, tokens).clone()
    dist.all_reduce(got, group=cp_mesh.get_group())
    what = f"[{folder} {method} {schedule} {spec} packed={packed}] rank {dist.get_rank()}"
    assert_close(got, want, floor=1e-6, what=f"{what} CE sum")
    for name, p in split.model.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no grad"
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_mesh.get_group())
        assert_close(grad, grads[name], floor=1e-6, what=f"{what} grad {name}")


def _worker(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    for case in CASES:
        _run_case(case, Path(root), mesh["pp"], mesh["cp"])


def test_pp2_cp2_generic_stages_equal_one_process(tmp_path: Path) -> None:
    _save(tmp_path)
    run_workers(_worker, 4, str(tmp_path), timeout=180)


def test_train_pp2_cp2_generic_equals_one_process(tmp_path: Path) -> None:
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, _config

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    # Rows are 32 tokens: a window of 12 reaches back over the CP chunk edges (8 or 16 tokens).
    hf = {**MISTRAL, "num_hidden_layers": 3, "tie_word_embeddings": True, "sliding_window": 12}
    transformers.MistralForCausalLM(transformers.MistralConfig(**hf)).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    config = _config(tmp_path, hf_dir)
    # 2 micro-batches of 2 rows per step (1f1b needs at least pp of them); no checkpoints.
    common = ["--training.global_batch_size=4", "--checkpoint.enable_save=false"]
    # FSDP shards over the 2 CP ranks of each stage, with the default generic units: their
    # model.embed_tokens and lm_head exist only on the first and the last stage (checked over
    # all stages, not per stage).
    fsdp: list[str] = []
    train_one(config, [*common, f"--training.output_dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = read_metrics(tmp_path / "one")
    assert len(one) == 3 and one[0]["loss"] != one[2]["loss"]  # it trains
    for method, schedule in LAYOUTS:
        out = tmp_path / method
        proc = train_one(
            config,
            [
                *common,
                *fsdp,
                f"--training.output_dir={out}",
                "--parallelism.pipeline_parallel=2",
                f"--parallelism.pipeline_parallel_schedule={schedule}",
                '--parallelism.pipeline_parallel_layers_per_stage=["0", "1-2"]',
                "--parallelism.context_parallel=2",
                f"--parallelism.context_parallel_method={method}",
            ],
            nproc=4,
            cwd=tmp_path,
        )
        assert "generic transformers path" in proc.stdout, proc.stdout
        assert f"CP ({method}) over 2 ranks" in proc.stdout and "pipeline stage(s)" in proc.stdout, (
            proc.stdout
        )
        got = read_metrics(out)
        assert len(got) == 3, got
        for x, y in zip(one, got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (method, x, y)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (method, x, y)
