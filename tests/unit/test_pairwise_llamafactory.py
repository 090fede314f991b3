"""Pairwise (DPO) rows against LLaMA-Factory's own converter and pairwise processor.

meshforge's rows come from the SFT data path (`build_sft_dataset(..., pairwise=True)`) on real
files; LLaMA-Factory's from its `DATASET_CONVERTERS` and `PairwiseDatasetProcessor` on the same
records. Each meshforge row is one pair (chosen = segment 1, rejected = segment 2): its segments
must equal LLaMA-Factory's chosen and rejected `input_ids` / `labels`. Runs only where
`llamafactory` imports (the Makefile's LF_REF, as tests/unit/test_sft_llamafactory.py).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
if "torchaudio" not in sys.modules:
    _stub = types.ModuleType("torchaudio")
    _stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    sys.modules["torchaudio"] = _stub

lf_template = pytest.importorskip("llamafactory.data.template")
lf_pairwise = pytest.importorskip("llamafactory.data.processor.pairwise")
lf_hparams = pytest.importorskip("llamafactory.hparams")

from meshforge.config import load_config  # noqa: E402
from meshforge.data.sft.loader import build_sft_dataset  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402
from meshforge.utils.resources import resolve_path  # noqa: E402

THINK = "<think>\nweigh it\n</think>\n\n"
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hello there"},
            {"from": "gpt", "value": THINK + "Hi! How can I help?"},
            {"from": "human", "value": "Tell me about cats. " * 15},
        ],
        "chosen": {"from": "gpt", "value": "Cats are small carnivorous mammals. " * 12},
        "rejected": {"from": "gpt", "value": THINK + "No."},
    },
    {
        "conversations": [{"from": "human", "value": "2+3?"}],
        "chosen": {"from": "gpt", "value": "5"},
        "rejected": {"from": "gpt", "value": "It is six, " * 30},
    },
    {  # broken: the chosen answer is a user turn (LLaMA-Factory 0.9.5 logs it and keeps it; dropped here)
        "conversations": [{"from": "human", "value": "hi"}],
        "chosen": {"from": "human", "value": "x"},
        "rejected": {"from": "gpt", "value": "y"},
    },
]
SHAREGPT_INFO = {
    "formatting": "sharegpt",
    "ranking": True,
    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
}
ALPACA_INFO = {
    "formatting": "alpaca",
    "ranking": True,
    "columns": {
        "prompt": "instruction",
        "query": "input",
        "chosen": "chosen",
        "rejected": "rejected",
        "history": "history",
    },
}


def _lf_rows(records, info, template, cutoff_len, enable_thinking=True):
    from llamafactory.data.converter import DATASET_CONVERTERS
    from llamafactory.data.parser import DatasetAttr as LFAttr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_path("meshforge://assets/tokenizer")))
    args = lf_hparams.DataArguments(template=template, cutoff_len=cutoff_len, enable_thinking=enable_thinking)
    lf_attr = LFAttr("file", "x", formatting=info["formatting"], ranking=True, **info["columns"])
    converter = DATASET_CONVERTERS[info["formatting"]](lf_attr, args)
    aligned = [converter(r) for r in records]
    batch = {k: [a[k] for a in aligned] for k in ("_prompt", "_response", "_system", "_tools")}
    for k in ("_images", "_videos", "_audios"):
        batch[k] = [None] * len(aligned)
    processor = lf_pairwise.PairwiseDatasetProcessor(
        template=lf_template.get_template_and_fix_tokenizer(tok, args),
        tokenizer=tok,
        processor=None,
        data_args=args,
    )
    return processor.preprocess_dataset(batch)


def _ours(tmp_path, records, info, template, cutoff_len, enable_thinking=True, packing=False):
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(records), encoding="utf-8")
    cfg = load_config(
        None,
        [
            "--training.stage=dpo",
            "--train_dataset.dataloader.type=SFTDataLoader",
            f"--train_dataset.template={template}",
            f"--train_dataset.cutoff_len={cutoff_len}",
            f"--train_dataset.enable_thinking={str(enable_thinking).lower()}",
            f"--train_dataset.packing={str(packing).lower()}",
            "--train_dataset.dataset=" + json.dumps({"file_name": str(data), **info}),
            "--model.tokenizer_name_or_path=meshforge://assets/tokenizer",
        ],
    )
    tok = build_tokenizer("meshforge://assets/tokenizer")
    lines = []
    rows = build_sft_dataset(cfg.train_dataset, tok, seed=0, log=lines.append, pairwise=True)
    return rows, lines


def _assert_same(rows, expected, cutoff_len):
    assert len(rows) == len(expected["chosen_input_ids"]) > 0
    assert rows.row_length == 2 * cutoff_len
    for i in range(len(rows)):
        row = rows.row(i)
        for seg, side in ((1, "chosen"), (2, "rejected")):
            keep = row["segment_ids"] == seg
            assert row["input_ids"][keep].tolist() == expected[f"{side}_input_ids"][i], (i, side)
            assert row["labels"][keep].tolist() == expected[f"{side}_labels"][i], (i, side)
            assert row["position_ids"][keep].tolist() == list(range(int(keep.sum())))
        assert len(expected["chosen_input_ids"][i]) <= cutoff_len


@pytest.mark.parametrize("cutoff_len", [40, 1024])
@pytest.mark.parametrize("template,enable_thinking", [("qwen3", True), ("qwen3", False), ("chatml", True)])
def test_sharegpt_pairs_equal_llamafactory(tmp_path, template, enable_thinking, cutoff_len):
    expected = _lf_rows(SHAREGPT[:-1], SHAREGPT_INFO, template, cutoff_len, enable_thinking)
    rows, lines = _ours(tmp_path, SHAREGPT, SHAREGPT_INFO, template, cutoff_len, enable_thinking)
    _assert_same(rows, expected, cutoff_len)
    assert any(
        "dropped 1 broken record(s): chosen or rejected is not an assistant turn x1" in s for s in lines
    )


@pytest.mark.parametrize("template", ["qwen3", "gpt_oss"])
def test_bundled_alpaca_pairs_equal_llamafactory(tmp_path, template):
    records = json.loads(resolve_path("meshforge://assets/sft/dpo_demo.json").read_text(encoding="utf-8"))
    assert any("history" in r for r in records)
    # `datasets` reads a missing key of a JSON record as None; LLaMA-Factory's converter indexes it.
    expected = _lf_rows([{**r, "history": r.get("history")} for r in records], ALPACA_INFO, template, 64)
    rows, _ = _ours(tmp_path, records, ALPACA_INFO, template, 64)
    _assert_same(rows, expected, 64)
    # Shifted into the batch contract, each segment's labels stay inside it.
    batch = rows.get_batch(np.arange(len(rows)))
    valid = batch["labels"] != -100
    chosen_tokens = (valid & (batch["segment_ids"] == 1)).sum(axis=1)
    assert chosen_tokens.tolist() == [sum(t != -100 for t in lab) for lab in expected["chosen_labels"]]


def test_packed_pairs_are_llamafactorys_pairs(tmp_path):
    """With packing, several pairs share a row (pair k in segments 2k + 1, 2k + 2): the same pairs."""
    records = json.loads(resolve_path("meshforge://assets/sft/dpo_demo.json").read_text(encoding="utf-8"))
    expected = _lf_rows([{**r, "history": r.get("history")} for r in records], ALPACA_INFO, "qwen3", 64)
    rows, lines = _ours(tmp_path, records, ALPACA_INFO, "qwen3", 64, packing=True)
    assert rows.row_length == 128 and len(rows) < len(records)
    assert any("packed pair train rows of 128 tokens" in line for line in lines)
    got = []
    for i in range(len(rows)):
        row = rows.row(i)
        assert len(row["input_ids"]) <= 128
        for k in range(int(row["segment_ids"].max()) // 2):
            pair = []
            for seg in (2 * k + 1, 2 * k + 2):
                keep = row["segment_ids"] == seg
                assert row["position_ids"][keep].tolist() == list(range(int(keep.sum())))
                pair += [tuple(row["input_ids"][keep].tolist()), tuple(row["labels"][keep].tolist())]
            got.append(tuple(pair))
    want = [
        tuple(
            tuple(expected[f"{side}_{key}"][i])
            for side in ("chosen", "rejected")
            for key in ("input_ids", "labels")
        )
        for i in range(len(records))
    ]
    assert sorted(got) == sorted(want)
