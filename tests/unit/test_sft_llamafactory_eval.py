"""Cross-check against LLaMA-Factory itself: the same validation split (val_size, streaming or not).

LLaMA-Factory's `split_dataset` (llamafactory/data/data_utils.py) runs on the mixed, aligned examples
before tokenisation: `train_test_split(val_size, seed)` for in-memory data, and
`shuffle(buffer_size, seed)` then `take`/`skip(val_size)` for a stream. Its choice depends only on
the number of examples, their order and the seed, so it is applied here to the raw records (mixed
with LLaMA-Factory's own `merge_dataset`) and compared with meshforge's validation and train rows,
example by example and in order.

Runs only where `llamafactory` imports (`make test` puts the test-only install on PYTHONPATH; see
tests/unit/test_sft_llamafactory.py for the stub it needs).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import sys
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
if "torchaudio" not in sys.modules:
    _stub = types.ModuleType("torchaudio")
    _stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    sys.modules["torchaudio"] = _stub

lf_data_utils = pytest.importorskip("llamafactory.data.data_utils")

import datasets  # noqa: E402

from meshforge.data.config import TrainDatasetConfig  # noqa: E402
from meshforge.data.sft.loader import build_sft_data  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def write(path, n, tag):
    rows = [{"instruction": f"{tag}{i} please", "input": "", "output": f"answer {i}"} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def ours(tok, ids):
    return re.search(r"\b([a-z]\d+) please", tok.decode(ids)).group(1)


def theirs(record):
    return record["instruction"].split()[0]


def args(**fields):
    defaults = {
        "val_size": 0.0,
        "streaming": False,
        "buffer_size": 16384,
        "mix_strategy": "concat",
        "interleave_probs": None,
    }
    return types.SimpleNamespace(**{**defaults, **fields})


def cfg(files, **fields):
    folder = os.path.dirname(files[0])
    names = [os.path.basename(f).split(".")[0] for f in files]
    info = {name: {"file_name": os.path.basename(f)} for name, f in zip(names, files, strict=True)}
    with open(os.path.join(folder, "dataset_info.json"), "w") as out:
        json.dump(info, out)
    return TrainDatasetConfig.model_validate(
        {
            "dataloader": {"type": "SFTDataLoader"},
            "template": "chatml",
            "cutoff_len": 48,
            "dataset": ",".join(names),
            "dataset_dir": folder,
            **fields,
        }
    )


@pytest.mark.parametrize("val_size", [0.2, 7, 0.05])
def test_val_size_split_equals_llamafactory(tmp_path, tok, val_size):
    files = [write(tmp_path / "a.jsonl", 30, "a"), write(tmp_path / "b.jsonl", 13, "b")]
    for seed in (0, 42):
        train, valid = build_sft_data(cfg(files, val_size=val_size), tok, seed=seed)
        raw = [datasets.load_dataset("json", data_files=[f], split="train") for f in files]
        merged = lf_data_utils.merge_dataset(raw, args(), seed)
        lf_train, lf_eval = lf_data_utils.split_dataset(merged, None, args(val_size=val_size), seed)
        expect_valid = [theirs(r) for r in lf_eval["validation"]]
        expect_train = [theirs(r) for r in lf_train["train"]]
        assert [ours(tok, valid.row(i)["input_ids"]) for i in range(len(valid))] == expect_valid
        assert [ours(tok, train.row(i)["input_ids"]) for i in range(len(train))] == expect_train


@pytest.mark.parametrize("mix", ["concat", "interleave_under"])
def test_streaming_split_equals_llamafactory(tmp_path, tok, mix):
    # dataset c is a folder of two files: one dataset, read file after file
    (tmp_path / "c").mkdir()
    folder = [write(tmp_path / "c" / "c1.jsonl", 6, "c"), write(tmp_path / "c" / "c2.jsonl", 5, "d")]
    files = [write(tmp_path / "a.jsonl", 25, "a"), write(tmp_path / "b.jsonl", 12, "b"), str(tmp_path / "c")]
    fields = {"streaming": True, "buffer_size": 8, "val_size": 5, "mix_strategy": mix}
    stream, valid = build_sft_data(cfg(files, **fields), tok, seed=7)
    # LLaMA-Factory loads a local dataset whole, then streams it as
    # `to_iterable_dataset(num_shards=dataloader_num_workers)`: one shard with the default 0 workers.
    raw = [
        datasets.load_dataset("json", data_files=data, split="train").to_iterable_dataset(num_shards=1)
        for data in ([files[0]], [files[1]], folder)
    ]
    lf_args = args(**fields)
    merged = lf_data_utils.merge_dataset(raw, lf_args, 7)
    lf_train, lf_eval = lf_data_utils.split_dataset(merged, None, lf_args, 7)
    assert [ours(tok, valid.row(i)["input_ids"]) for i in range(len(valid))] == [
        theirs(r) for r in lf_eval["validation"]
    ]
    assert [ours(tok, r["input_ids"]) for r in stream.rows(0)] == [theirs(r) for r in lf_train["train"]]
