"""A grown vocabulary on sharded parameters (2 gloo ranks) equals one process.

One launch checks two layouts: FSDP2 over the whole model (embedding and LM head sharded by rows,
the HF rows loaded from each rank's slice of the file, new rows written by both ranks) and
embedding/head DTensors sharded by columns (Shard(1)). In both, the gathered tables after
`load_hf_weights(..., vocab_plan=plan)` and `init_new_rows` equal the single-process ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

TOKENIZER = "meshforge://assets/tokenizer"  # 8192 tokens
DESCRIPTIONS = {"<think>": "the start of a reasoning", "</think>": "the end of a reasoning"}
OPTIONS = {
    "vocab_size": 8192,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
TABLES = ("model.embed_tokens.weight", "lm_head.weight")
LAYOUTS = {"fsdp": "desc_init_w_noise", "columns": "noise_init"}


def _grown(hf_dir: str, layout: str | None, mesh=None) -> dict[str, torch.Tensor]:
    """Build with the plan, (shard,) load, init the new rows; the full tables."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from meshforge.checkpoint.hf import load_hf_weights
    from meshforge.data.tokenizer import build_tokenizer
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.models.vocab import init_new_rows, vocab_plan
    from meshforge.parallel.fsdp import apply_fsdp

    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS, add_tokens="<a>")
    family = resolve_family("qwen3")
    plan = vocab_plan(tok, OPTIONS["vocab_size"], resize_vocab=False)
    with torch.device("meta"):
        model = family.build(plan.model_options(OPTIONS))
    if layout == "fsdp":
        apply_fsdp(model, mesh, param_dtype=None, reduce_dtype=torch.float32)
    materialize_and_init(model, device=torch.device("cpu"), seed=0, init_fn=lambda *_: None)
    if layout == "columns":
        for module in (model.model.embed_tokens, model.lm_head):
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(1)]))
    load_hf_weights(model, family, hf_dir, vocab_plan=plan)
    mode = LAYOUTS[layout] if layout else None
    out = {}
    for m in LAYOUTS.values() if mode is None else [mode]:
        init_new_rows(model, plan, tok, m, seed=5)
        params = dict(model.named_parameters())
        for name in TABLES:
            value = params[name].detach()
            if isinstance(value, DTensor):
                assert value.to_local().numel() < value.numel()  # really sharded
                value = value.full_tensor()
            out[f"{m}:{name}"] = value.clone()
    return out


def _worker(rank: int, world: int, hf_dir: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layout in LAYOUTS:
        tables = _grown(hf_dir, layout, mesh)
        if rank == 0:
            torch.save(tables, Path(out_dir) / f"{layout}.pt")


def test_two_rank_grown_vocabulary_equals_one_process(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**OPTIONS)).save_pretrained(hf_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_workers(_worker, 2, str(hf_dir), str(tmp_path))

    single = _grown(str(hf_dir), None)
    for layout, mode in LAYOUTS.items():
        sharded = torch.load(tmp_path / f"{layout}.pt")
        for name in TABLES:
            key = f"{mode}:{name}"
            assert sharded[key].shape == (8256, 32)
            assert torch.equal(sharded[key], single[key]), (layout, key)
