"""The generic Hugging Face path under FSDP2: 2 gloo ranks (torchrun) train like 1 process.

A tiny `transformers.MistralForCausalLM` (no built-in meshforge family) trains 3 steps with
`parallelism.fsdp_modules` written with `{}` (accepted as `{*}`), with untied and tied embeddings; the losses on 2 ranks equal
those of 1 process, and both exports hold the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._compare import max_rel_error, rel_error
from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.unit.test_generic_hf import MISTRAL, _config

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_generic_fsdp_two_ranks_equal_one_process(tmp_path: Path, tied: bool) -> None:
    # Tied: embed_tokens and lm_head share a parameter, so neither is its own unit (the root keeps it).
    from safetensors.torch import load_file

    from meshforge.data.tokenizer import build_tokenizer

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    config_hf = transformers.MistralConfig(**{**MISTRAL, "tie_word_embeddings": tied})
    transformers.MistralForCausalLM(config_hf).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    extra = 'parallelism:\n  fsdp_modules: ["model.layers.{}", "model.embed_tokens", "lm_head"]'
    config = _config(tmp_path, hf_dir, extra)
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        # Same global batch of 2: 2 x 1 on two ranks.
        args = [f"--training.output_dir={out}", "--checkpoint.save_hf_weights=true"]
        args.append(f"--training.local_batch_size={2 // nproc}")
        proc = train_one(config, args, nproc=nproc, cwd=tmp_path)
        assert "generic transformers path" in proc.stdout
        runs[nproc] = out
    one, two = read_metrics(runs[1]), read_metrics(runs[2])
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    a, b = load_file(runs[1] / "hf" / "model.safetensors"), load_file(runs[2] / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        # Trained weights: 1e-5 in norm, 1e-4 of the largest weight elementwise (Adam moves an
        # element whose gradient is a near-zero cancellation by its own rounding).
        assert rel_error(b[key], a[key]) <= 1e-5 and max_rel_error(b[key], a[key]) <= 1e-4, key
