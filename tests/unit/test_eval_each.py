"""Per-dataset evaluation (`train_dataset.eval_on_each_dataset`): one validation part per eval
dataset, through the data pipeline, `tokenized_path` and streaming, and the metrics of each part."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.config import config_from_dict  # noqa: E402
from meshforge.config.noops import noop_notes  # noqa: E402
from meshforge.data.build import MIXED_EVAL, LoaderContext, build_eval_loader, build_eval_loaders  # noqa: E402
from meshforge.data.config import TrainDatasetConfig  # noqa: E402
from meshforge.data.sft.loader import build_sft_data, build_sft_parts  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402
from meshforge.train.evaluation import eval_line, eval_metrics, eval_sums  # noqa: E402

X = -100


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def write_alpaca(path, n, tag, words=1):
    rows = [
        {"instruction": f"{tag}{i} please" + " more" * (words * i % 5), "input": "", "output": f"answer {i}"}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture
def data_dir(tmp_path):
    write_alpaca(tmp_path / "train.jsonl", 12, "t")
    write_alpaca(tmp_path / "a.jsonl", 7, "a")
    write_alpaca(tmp_path / "b.jsonl", 4, "b", words=3)
    info = {name: {"file_name": f"{name}.jsonl"} for name in ("train", "a", "b")}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def sft(data_dir, **fields):
    return TrainDatasetConfig.model_validate(
        {
            "dataloader": {"type": "SFTDataLoader"},
            "template": "chatml",
            "cutoff_len": 48,
            "dataset": "train",
            "dataset_dir": str(data_dir),
            **fields,
        }
    )


def loaders(cfg, tok, *, dp_rank=0, dp_size=1):
    ctx = LoaderContext(tokenizer=tok, local_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=0)
    return build_eval_loaders(cfg, ctx)


def bigram(vocab):
    """A bigram table as the tiny model: the summed CE of a batch, in float64."""
    weight = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def forward(batch):
        logits = weight[batch["input_ids"]]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=X, reduction="sum"
        )

    return forward


def metrics_of(named, forward):
    return eval_metrics(
        {name: eval_sums(forward, loader, device="cpu") for name, loader in named.items()}, loss_group=None
    )


def test_two_eval_datasets_give_two_losses_whose_token_mean_is_the_mixed_loss(data_dir, tok):
    forward = bigram(len(tok))
    each = loaders(sft(data_dir, eval_dataset="a,b", eval_on_each_dataset=True), tok)
    mixed = loaders(sft(data_dir, eval_dataset="a,b"), tok)
    assert list(each) == ["a", "b"] and list(mixed) == [MIXED_EVAL]
    assert [each["a"].num_samples, each["b"].num_samples, mixed[MIXED_EVAL].num_samples] == [7, 4, 11]
    split, one = metrics_of(each, forward), metrics_of(mixed, forward)
    # Only the named parts have metrics of their own.
    assert set(one) == {"eval_loss", "eval_tokens"}
    assert set(split) == {
        "eval_loss",
        "eval_tokens",
        *(f"eval_{k}/{n}" for k in ("loss", "tokens") for n in "ab"),
    }
    # Each part is the data of that dataset alone (the mixed set of one dataset).
    for name in "ab":
        alone = metrics_of(loaders(sft(data_dir, eval_dataset=name), tok), forward)
        assert split[f"eval_tokens/{name}"] == alone["eval_tokens"]
        assert math.isclose(split[f"eval_loss/{name}"], alone["eval_loss"], rel_tol=1e-12)
    assert split["eval_loss/a"] != pytest.approx(split["eval_loss/b"], rel=1e-3)  # the data differ
    tokens = [split["eval_tokens/a"], split["eval_tokens/b"]]
    assert sum(tokens) == split["eval_tokens"] == one["eval_tokens"]
    weighted = (split["eval_loss/a"] * tokens[0] + split["eval_loss/b"] * tokens[1]) / sum(tokens)
    assert math.isclose(weighted, one["eval_loss"], rel_tol=1e-12)
    assert math.isclose(split["eval_loss"], one["eval_loss"], rel_tol=1e-12)
    line = eval_line(split)
    assert line.startswith("eval_loss ") and "; eval_loss/a " in line and "; eval_loss/b " in line


def test_parts_over_two_ranks_add_up_to_the_one_rank_sums(data_dir, tok):
    forward = bigram(len(tok))
    cfg = sft(data_dir, eval_dataset="a,b", eval_on_each_dataset=True)
    whole = {name: eval_sums(forward, loader, device="cpu") for name, loader in loaders(cfg, tok).items()}
    ranks = [loaders(cfg, tok, dp_rank=r, dp_size=2) for r in range(2)]
    for name in ("a", "b"):
        added = sum(eval_sums(forward, rank[name], device="cpu") for rank in ranks)
        assert torch.allclose(added, whole[name], rtol=1e-12, atol=0)


def test_each_part_is_packed_within_its_dataset(data_dir, tok):
    fields = {"eval_dataset": "a,b", "packing": True, "neat_packing": True}
    _, parts = build_sft_parts(sft(data_dir, eval_on_each_dataset=True, **fields), tok, seed=0)
    _, mixed = build_sft_parts(sft(data_dir, **fields), tok, seed=0)
    for name, rows in parts.items():
        text = tok.decode(rows.flat["input_ids"])
        other = "b" if name == "a" else "a"
        assert f"{name}0 please" in text and f"{other}0 please" not in text
    assert sum(rows.real_tokens() for rows in parts.values()) == mixed[MIXED_EVAL].real_tokens()


def test_tokenized_path_saves_and_loads_the_parts(data_dir, tok):
    fields = {"eval_dataset": "a,b", "eval_on_each_dataset": True, "tokenized_path": str(data_dir / "tok")}
    _, first = build_sft_parts(sft(data_dir, **fields), tok, seed=0)
    assert json.loads((data_dir / "tok" / "eval_dataset_names.json").read_text()) == ["a", "b"]
    lines = []
    # loaded back: the saved parts come back under their names, whatever the options now say
    _, second = build_sft_parts(
        sft(data_dir, tokenized_path=str(data_dir / "tok")), tok, seed=0, log=lines.append
    )
    assert any("eval_on_each_dataset" in line and "ignored" in line for line in lines)
    assert list(second) == ["a", "b"]
    for name in ("a", "b"):
        assert np.array_equal(second[name].flat["input_ids"], first[name].flat["input_ids"])
        assert np.array_equal(second[name].flat["labels"], first[name].flat["labels"])
    # One saved validation set stays one part.
    single = {"eval_dataset": "a,b", "tokenized_path": str(data_dir / "tok1")}
    build_sft_parts(sft(data_dir, **single), tok, seed=0)
    _, again = build_sft_parts(sft(data_dir, **single), tok, seed=0)
    assert list(again) == [MIXED_EVAL] and len(again[MIXED_EVAL]) == 11


def test_streaming_reads_the_same_parts(data_dir, tok):
    fields = {"eval_dataset": "a,b", "eval_on_each_dataset": True}
    _, streamed = build_sft_parts(sft(data_dir, streaming=True, **fields), tok, seed=0)
    _, in_memory = build_sft_parts(sft(data_dir, **fields), tok, seed=0)
    assert list(streamed) == list(in_memory) == ["a", "b"]
    for name in ("a", "b"):
        assert np.array_equal(streamed[name].flat["input_ids"], in_memory[name].flat["input_ids"])


def test_refusals_and_the_val_size_no_op(data_dir, tok):
    with pytest.raises(ValueError, match=r"train_dataset\.eval_dataset: a named more than once"):
        build_sft_parts(sft(data_dir, eval_dataset="a,a", eval_on_each_dataset=True), tok, seed=0)
    each = sft(data_dir, eval_dataset="a,b", eval_on_each_dataset=True)
    with pytest.raises(ValueError, match="build_sft_parts"):
        build_sft_data(each, tok, seed=0)
    ctx = LoaderContext(tokenizer=tok, local_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="build_eval_loaders"):
        build_eval_loader(each, ctx)
    # With val_size the split comes from the mixed training data: one set, the flag warned.
    split = loaders(sft(data_dir, val_size=3, eval_on_each_dataset=True), tok)
    assert list(split) == [MIXED_EVAL] and split[MIXED_EVAL].num_samples == 3
    cfg = config_from_dict(
        {"train_dataset": {"dataset": "train", "val_size": 3, "eval_on_each_dataset": True}}
    )
    notes = dict(noop_notes(cfg, "cpu"))
    assert "mixed training data" in notes["train_dataset.eval_on_each_dataset"]
    with_eval = config_from_dict({"train_dataset": {"eval_dataset": "a,b", "eval_on_each_dataset": True}})
    assert "train_dataset.eval_on_each_dataset" not in dict(noop_notes(with_eval, "cpu"))
