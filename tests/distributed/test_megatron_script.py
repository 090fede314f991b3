"""Done-when of issue 25's Megatron part: a MindSpeed-LLM qwen3 pretrain script, edited only in
paths, sizes, precision (fp32 on the CPU) and `pretrain_gpt.py` -> `-m meshforge megatron`
(tests/data/megatron_scripts/qwen3_tiny_pretrain.sh), trains on 2 processes through
`meshforge train SCRIPT.sh`, and its first loss equals transformers' loss, for the same
config.json and weights (the script's `--load`), on the first global batch of megatron-core's
GPTDataset for the same flags (seed, sequence length, split, train_iters x global_batch samples).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.unit._megatron_scripts import TOKENIZER, filled

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "megatron"
SEQ, GBS, ITERS, SEED = 64, 4, 2, 42


def _hf_folder(path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.3,  # sharper logits: batches' losses differ well beyond the tolerance
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)


def _megatron_core_batch(prefix: Path, cache: Path, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first global batch megatron-core's GPTDataset gives for the script's flags."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gd = pytest.importorskip("megatron.core.datasets.gpt_dataset")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    class Tok:
        pad, vocab_size = -1, 8192
        unique_identifiers = {"class": "Tok"}

    Tok.eod = eod
    cfg = gd.GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=([str(prefix)], None),
        split="100,0,0",
        tokenizer=Tok(),
        path_to_cache=str(cache),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = BlendedMegatronDatasetBuilder(gd.GPTDataset, [ITERS * GBS, 0, 0], lambda: True, cfg).build()[
            0
        ]
    rows = [train[i] for i in range(2 * GBS)]
    return torch.stack([r["tokens"] for r in rows]), torch.stack([r["labels"] for r in rows])


def test_qwen3_pretrain_script_trains_and_its_first_loss_equals_transformers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(ASSETS / f"python_docstrings_text_document{suffix}", data)
    prefix = data / "python_docstrings_text_document"
    hf = tmp_path / "qwen3_hf"
    _hf_folder(hf)
    save = tmp_path / "save"
    script = filled(
        "qwen3_tiny_pretrain.sh",
        tmp_path,
        {"CKPT_LOAD_DIR": hf, "CKPT_SAVE_DIR": save, "DATA_PATH": prefix, "TOKENIZER_PATH": TOKENIZER},
    )
    run = train_one(script, [], nproc=2, cwd=tmp_path)
    log = run.stdout
    assert "a Megatron-style launch script" in log
    assert "--tensor-model-parallel-size 1 -> parallelism.tensor_parallel: 1" in log
    assert "--use-flash-attn: no effect here" in log
    assert "launcher: torchrun --nproc_per_node 2" in log
    assert "training.output_dir" in log and "beside the checkpoints" in log
    records = read_metrics(save)  # outputs beside --save: no output folder is named
    assert [r["step"] for r in records] == [1, 2]

    from transformers import AutoModelForCausalLM

    from meshforge.config.megatron_import import _eos_id

    eod = _eos_id(str(TOKENIZER))
    assert eod is not None
    tokens, labels = _megatron_core_batch(prefix, tmp_path / "mcore_cache", eod)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.double()

    def loss(rows: slice) -> float:
        return torch.nn.functional.cross_entropy(
            logits[rows].reshape(-1, logits.shape[-1]), labels[rows].reshape(-1)
        ).item()

    want, second_batch = loss(slice(0, GBS)), loss(slice(GBS, 2 * GBS))
    got = records[0]["loss"]
    assert np.isfinite(got) and abs(got - want) / want < 2e-5, (got, want)
    # the comparison can tell batches apart: megatron-core's second global batch gives another loss
    assert abs(second_batch - want) / want > 1e-3, (second_batch, want)


@pytest.mark.procs
def test_torchrun_runs_meshforge_megatron_with_the_shipped_scripts_flags(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m meshforge megatron FLAGS`: the flags of
    configs/megatron/pretrain_qwen3_tiny.sh's training line, paths and length given again at the
    end (the last value counts, as in Megatron); the world size is torchrun's."""
    import subprocess

    from meshforge.config.launch_script import read_script
    from tests.conftest import meshforge_cmd, worker_env

    repo = Path(__file__).resolve().parents[2]
    line = read_script(str(repo / "configs" / "megatron" / "pretrain_qwen3_tiny.sh"))
    assert line.entry == "-m meshforge megatron" and line.launcher[0] == "torchrun"
    save = tmp_path / "save"
    again = [
        "--data-path", str(ASSETS / "python_docstrings_text_document"), "--tokenizer-name-or-path", str(TOKENIZER),
        "--data-cache-path", str(tmp_path / "cache"), "--save", str(save), "--train-iters", "2",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--num-layers", "1", "--hidden-size", "64",
        "--ffn-hidden-size", "128", "--kv-channels", "16",
    ]  # fmt: skip
    cmd = meshforge_cmd("megatron", *line.flags, *again, nproc=2)
    proc = subprocess.run(cmd, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--train-iters given twice ('10', then '2')" in proc.stdout
    assert "--tensor-model-parallel-size 1 -> parallelism.tensor_parallel: 1" in proc.stdout
    assert "global batch 4 = dp 2 x local 2 x accumulation 1" in proc.stdout  # torchrun's 2 ranks
    assert [r["step"] for r in read_metrics(save)] == [1, 2]
