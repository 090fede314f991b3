"""Pipeline x context parallelism on the generic transformers path (4 processes) equals one process.

``meshforge train`` on a generic Mistral folder (no built-in family; 3 layers, a sliding window
shorter than the rows so it crosses the CP chunk boundaries, tied embeddings so the head copy on
the last stage is kept equal) with ``--parallelism.pipeline_parallel=2`` and
``--parallelism.context_parallel=2``: each pipeline stage builds the per-forward CP state and the
global positions itself (the wrapper's forward does it in one process) and hands the state to its
transformers layers. Colossal (ring) with 1f1b and ulysses with gpipe, an uneven explicit layer
split, 3 steps: the logged loss and grad norm equal the one-process run's within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

# (method, schedule) per 4-process launch.
LAYOUTS = [("colossal", "1f1b"), ("ulysses", "gpipe")]


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
    # FSDP shards over the 2 CP ranks of each stage. The default generic units name
    # model.embed_tokens and lm_head, which a pipeline stage holds only on the first or last
    # stage (and a pattern that matches nothing is an error): one unit per decoder layer here.
    fsdp = ['--parallelism.fsdp_modules=["model.layers.{*}"]']
    run_train(config, [*common, f"--training.output_dir={tmp_path / 'one'}"], cwd=tmp_path)
    one = read_metrics(tmp_path / "one")
    assert len(one) == 3 and one[0]["loss"] != one[2]["loss"]  # it trains
    for method, schedule in LAYOUTS:
        out = tmp_path / method
        proc = run_train(
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
