"""Pipeline parallelism in the trainer: evaluation through the schedule, and the dx/dw split.

The runs are whole trainer runs in-process (`train_all`: one process here, the 2-rank layouts in
the shared rank pool); the CLI around them is tested in tests/unit/test_train_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import Run, train_all

pytestmark = pytest.mark.slow

SFT = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
COMMON = [
    "--training.steps=2",
    "--training.log_interval=1",
    "--training.eval_interval=1",
    "--training.eval_iters=3",
    "--train_dataset.val_size=24",
    "--train_dataset.max_samples=120",
    "--checkpoint.enable_save=false",
]


def test_pp2_evaluates_and_zero_bubble_equals_one_process(tmp_path: Path) -> None:
    one, pp, zb, ppcp = tmp_path / "one", tmp_path / "pp", tmp_path / "zb", tmp_path / "ppcp"
    train_all(
        [
            Run(SFT, [*COMMON, f"--training.output_dir={one}"]),
            Run(SFT, [*COMMON, "--parallelism.pipeline_parallel=2", f"--training.output_dir={pp}"], nproc=2),
            Run(
                SFT,
                [
                    *COMMON,
                    "--parallelism.pipeline_parallel=2",
                    "--parallelism.pipeline_parallel_schedule=interleaved",
                    "--parallelism.pipeline_parallel_interleave_num=2",
                    "--parallelism.pipeline_parallel_enable_dxdw_split=true",
                    f"--training.output_dir={zb}",
                ],
                nproc=2,
            ),
            # The validation batches reach the first stage split over the CP ranks, as training's.
            Run(
                SFT,
                [
                    *COMMON,
                    "--parallelism.pipeline_parallel=2",
                    "--parallelism.context_parallel=2",
                    f"--training.output_dir={ppcp}",
                ],
                nproc=4,
            ),
        ]
    )
    ref = read_metrics(one)
    assert [r["step"] for r in ref if "eval_loss" in r] == [1, 2]
    for run in (pp, zb, ppcp):
        got = read_metrics(run)
        for x, y in zip(ref, got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
            assert y["eval_loss"] == pytest.approx(x["eval_loss"], rel=1e-5)
            assert y["eval_tokens"] == x["eval_tokens"]


def test_tied_embeddings_resume_across_pipeline_layouts(tiny_config: Path, tmp_path: Path) -> None:
    # The last stage keeps a copy of the tied head: its optimizer state must come from the
    # embedding's when the checkpoint was saved tied (one process), and go back to it.
    common = ["--training.steps=4", "--checkpoint.save_interleaved_steps=2"]
    pp2 = ["--parallelism.pipeline_parallel=2"]
    one, pp, to_pp, to_one = (tmp_path / n for n in ("one", "pp", "to_pp", "to_one"))
    step2 = "checkpoints/checkpoint-00000002"
    train_all(
        [
            Run(tiny_config, [*common, f"--training.output_dir={one}"]),
            Run(tiny_config, [*common, *pp2, f"--training.output_dir={pp}"], nproc=2),
            Run(
                tiny_config,
                [*common, *pp2, f"--training.output_dir={to_pp}", f"--checkpoint.load_path={one / step2}"],
                nproc=2,
            ),
            Run(
                tiny_config,
                [*common, f"--training.output_dir={to_one}", f"--checkpoint.load_path={pp / step2}"],
            ),
        ]
    )
    ref = read_metrics(one)
    for resumed in (to_pp, to_one):
        got = read_metrics(resumed)
        assert [r["step"] for r in got] == [3, 4]
        for x, y in zip(ref[2:], got, strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_pp2_trains_from_a_hugging_face_folder(tmp_path: Path, tied: bool) -> None:
    # Each stage loads only its own weights from the folder; the last stage's tied head copy
    # takes the embedding's stored rows.
    from tests.conftest import write_corpus
    from tests.unit.test_hf_interop import _save_hf_model

    folder = _save_hf_model(tmp_path / "hf", tied=tied, shard="60KB")
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=40)
    config = tmp_path / "from_hf.yaml"
    config.write_text(
        f"""
training: {{steps: 3, local_batch_size: 1, global_batch_size: 4, seed: 5}}
lr_scheduler: {{type: ConstantWarmUpLR, learning_rate: 1.e-3, warmup_steps: 0}}
train_dataset:
  dataloader: {{type: TextDataLoader, data_path: {corpus}, seq_length: 32}}
model: {{model_name_or_path: {folder}}}
checkpoint: {{enable_save: false}}
"""
    )
    one, pp = tmp_path / "one", tmp_path / "pp"
    train_all(
        [
            Run(config, [f"--training.output_dir={one}"]),
            Run(config, ["--parallelism.pipeline_parallel=2", f"--training.output_dir={pp}"], nproc=2),
        ]
    )
    for x, y in zip(read_metrics(one), read_metrics(pp), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
