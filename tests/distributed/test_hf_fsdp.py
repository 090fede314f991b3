"""HF weights load straight into FSDP2 shards (2 gloo ranks), train, and export back from them.

One launch checks both directions: every rank's shards, gathered, equal the safetensors tensors
(so the 2-rank load equals the 1-process load, which the unit tests compare with transformers),
and `save_hf` from the sharded model writes exactly the tensors it loaded. A torchrun case runs
`meshforge train` from a HF folder on 1 and 2 ranks and compares losses and exports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import max_rel_error, rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

OPTIONS = {
    "vocab_size": 257,  # uneven shards over 2 ranks (129 + 128 rows)
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _worker(rank: int, world: int, hf_dir: str, out_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.checkpoint import hf
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply_fsdp

    family = resolve_family("qwen3")
    model = family.build(OPTIONS)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, mesh, param_dtype=None, reduce_dtype=torch.float32)
    materialize_and_init(model, device=torch.device("cpu"), seed=0, init_fn=lambda *_: None)
    # Count the reads that take only this rank's slice from disk (every parameter here).
    calls = []
    real = hf._copy_local_slice
    hf._copy_local_slice = lambda *a: (calls.append(a[0]), real(*a))
    hf.load_hf_weights(model, family, hf_dir)
    assert len(calls) == len(list(model.parameters())), calls
    local = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"].to_local()
    assert local.shape[0] == OPTIONS["intermediate_size"] // world  # really sharded
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, Path(out_dir) / "loaded.pt")
    hf.save_hf(model, family, Path(out_dir) / "export", shard_size="40KB")


def test_two_rank_load_and_export_match_the_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    # A checkpoint with distinct random tensors under the HF keys (written as transformers does).
    from meshforge.models.registry import resolve_family

    with torch.device("meta"):
        names = {n: p.shape for n, p in resolve_family("qwen3").build(OPTIONS).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(shape, generator=gen) for n, shape in names.items()}
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})

    run_workers(_worker, 2, str(hf_dir), str(tmp_path))

    loaded = torch.load(tmp_path / "loaded.pt")
    assert set(loaded) - {"lm_head.weight"} <= set(tensors) and set(tensors) <= set(loaded)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    export = tmp_path / "export"
    written: dict[str, torch.Tensor] = {}
    for file in sorted(export.glob("model-*.safetensors")):
        written.update(load_file(str(file)))
    assert (export / "model.safetensors.index.json").is_file() and len(list(export.glob("model-*"))) > 1
    assert written.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name


def test_torchrun_training_from_hf_folder_equals_one_process(tmp_path: Path) -> None:
    """`meshforge train` on 2 ranks from a HF folder: same losses and exported weights as 1 process."""
    from safetensors.torch import load_file

    from tests.conftest import read_metrics
    from tests.distributed._layouts import train_one
    from tests.unit.test_hf_interop import _config, _save_hf_model

    hf_dir = _save_hf_model(tmp_path / "hf", tied=True, shard="100KB")
    cfg = _config(tmp_path, "cfg", f"  model_name_or_path: {hf_dir}")
    common = ["--training.global_batch_size=4", "--checkpoint.save_hf_weights=true"]
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        train_one(cfg, [*common, f"--training.output_dir={out}"], nproc=nproc, cwd=tmp_path)
        runs[nproc] = out
    one, two = (read_metrics(runs[n]) for n in (1, 2))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    a = load_file(str(runs[1] / "hf" / "model.safetensors"))
    b = load_file(str(runs[2] / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # tied: one tensor, as transformers writes
    for name in a:
        # Trained weights: 1e-5 in norm, 1e-4 of the largest weight elementwise (Adam moves an
        # element whose gradient is a near-zero cancellation by its own rounding).
        assert rel_error(b[name], a[name]) <= 1e-5 and max_rel_error(b[name], a[name]) <= 1e-4, name
