"""Validation data (SFT val_size / eval_dataset, Megatron valid split), EvalLoader sharding,
`evaluate` against a hand computation, and training.epochs sizing."""

from __future__ import annotations

import json
import math
import os
import re
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.data.build import LoaderContext, build_eval_loader, build_train_loader  # noqa: E402
from meshforge.data.config import TrainDatasetConfig  # noqa: E402
from meshforge.data.epochs import steps_for_epochs  # noqa: E402
from meshforge.data.loader import EvalLoader  # noqa: E402
from meshforge.data.megatron.indexed import IndexedDatasetWriter  # noqa: E402
from meshforge.data.sft.loader import build_sft_data  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402
from meshforge.train.evaluation import evaluate  # noqa: E402

X = -100
EOD = 0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def write_alpaca(path, n, tag="q"):
    rows = [{"instruction": f"{tag}{i} please", "input": "", "output": f"answer {i}"} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def sft(**fields):
    return TrainDatasetConfig.model_validate(
        {"dataloader": {"type": "SFTDataLoader"}, "template": "chatml", "cutoff_len": 48, **fields}
    )


def tags(tok, ds, tag="q"):
    """The example number of every row of an SFTDataset, in row order."""
    out = []
    for i in range(len(ds)):
        text = tok.decode(ds.row(i)["input_ids"])
        out.append(int(re.search(rf"\b{tag}(\d+) please", text).group(1)))
    return out


class Numbers:
    """Sample i is a row of four tokens (i, i, i, i), labels the same: easy to trace."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def get_batch(self, indices):
        rows = np.repeat(np.asarray(indices, dtype=np.int64)[:, None], 4, axis=1)
        return {"input_ids": rows, "labels": rows.copy()}


# ------------------------------------------------------------------------------------------ SFT


@pytest.mark.parametrize("val_size, expected", [(0.25, 5), (6, 6)])
def test_val_size_splits_off_examples_disjoint_from_train(tmp_path, tok, val_size, expected):
    write_alpaca(tmp_path / "a.jsonl", 20)
    cfg = sft(dataset={"file_name": str(tmp_path / "a.jsonl")}, val_size=val_size)
    train, valid = build_sft_data(cfg, tok, seed=3)
    train_ids, valid_ids = tags(tok, train), tags(tok, valid)
    # a fraction takes ceil(0.25 * 20) = 5 examples (datasets' train_test_split), an integer that many
    assert len(valid_ids) == expected and len(train_ids) == 20 - expected
    assert sorted(train_ids + valid_ids) == list(range(20))
    # seeded: the same seed gives the same split, another seed another one
    assert tags(tok, build_sft_data(cfg, tok, seed=3)[1]) == valid_ids
    assert tags(tok, build_sft_data(cfg, tok, seed=4)[1]) != valid_ids


def test_train_loader_never_yields_validation_examples(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 16)
    cfg = sft(dataset={"file_name": str(tmp_path / "a.jsonl")}, val_size=4, drop_remainder=False)
    kw = {"tokenizer": tok, "local_batch_size": 2, "dp_size": 2, "seed": 0, "global_batch_size": 4}
    # The contexts of both ranks share one `shared` memo here, so all four loaders come from one
    # pipeline run (same objects), as the train and eval loader of one rank's context do in a run.
    shared: dict[str, object] = {}
    contexts = [LoaderContext(dp_rank=r, shared=shared, **kw) for r in range(2)]
    loaders = [build_train_loader(cfg, ctx) for ctx in contexts]
    evals = [build_eval_loader(cfg, ctx) for ctx in contexts]
    assert loaders[0].num_samples == 12 and evals[0].num_samples == 4
    assert loaders[0].dataset is loaders[1].dataset and evals[0].dataset is evals[1].dataset

    def numbers(batch):
        out = []
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            if (labels != X).any():
                out.append(int(re.search(r"q(\d+) please", tok.decode(ids)).group(1)))
        return out

    seen = [n for _ in range(3) for ld in loaders for n in numbers(next(ld))]
    held = [n for ld in evals for batch in ld for n in numbers(batch)]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 12  # one epoch: 12 train examples
    assert sorted(seen + held) == list(range(16))


def test_eval_dataset_is_separate_data_and_none_without_eval(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 10)
    write_alpaca(tmp_path / "b.jsonl", 3, tag="e")
    cfg = sft(
        dataset={"file_name": str(tmp_path / "a.jsonl")},
        eval_dataset={"file_name": str(tmp_path / "b.jsonl")},
    )
    train, valid = build_sft_data(cfg, tok, seed=0)
    assert sorted(tags(tok, train)) == list(range(10)) and tags(tok, valid, "e") == [0, 1, 2]
    kw = {"tokenizer": tok, "local_batch_size": 2, "dp_rank": 0, "dp_size": 1, "seed": 0}
    plain = sft(dataset={"file_name": str(tmp_path / "a.jsonl")})
    assert build_eval_loader(plain, LoaderContext(**kw)) is None
    with pytest.raises(ValueError, match=r"train_dataset\.eval_dataset\[0\]: 'missing' is not in"):
        (tmp_path / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.jsonl"}}))
        build_sft_data(sft(dataset="a", eval_dataset="missing", dataset_dir=str(tmp_path)), tok, seed=0)
    with pytest.raises(ValueError, match=r"val_size: 10 validation examples, but the data has only 10"):
        build_sft_data(sft(dataset={"file_name": str(tmp_path / "a.jsonl")}, val_size=10), tok, seed=0)
    text = TrainDatasetConfig.model_validate(
        {"dataloader": {"type": "TextDataLoader", "data_path": "x.txt", "seq_length": 8}}
    )
    assert build_eval_loader(text, LoaderContext(**kw)) is None


def test_tokenized_path_keeps_the_validation_part(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 12)
    fields = {"dataset": {"file_name": str(tmp_path / "a.jsonl")}, "tokenized_path": str(tmp_path / "tok")}
    first_train, first_valid = build_sft_data(sft(val_size=3, **fields), tok, seed=1)
    lines = []
    # loaded back: val_size is ignored (as every other data option), the saved split is kept
    second_train, second_valid = build_sft_data(sft(**fields), tok, seed=1, log=lines.append)
    assert any("val_size" in line and "ignored" in line for line in lines)
    assert tags(tok, second_valid) == tags(tok, first_valid) and len(second_valid) == 3
    assert tags(tok, second_train) == tags(tok, first_train)


# ------------------------------------------------------------------------------------ EvalLoader


@pytest.mark.parametrize("n, local, dp", [(7, 2, 1), (7, 2, 2), (8, 2, 2), (5, 3, 2)])
def test_eval_loader_covers_every_sample_once_and_restarts(n, local, dp):
    loaders = [EvalLoader(Numbers(n), local_batch_size=local, dp_rank=r, dp_size=dp) for r in range(dp)]
    passes = []
    for _ in range(2):  # every `for` loop starts from the first sample again
        real, shapes = [], set()
        for ld in loaders:
            batches = list(ld)
            assert len(batches) == len(ld) == math.ceil(n / (local * dp))
            for batch in batches:
                shapes.add(tuple(batch["input_ids"].shape))
                for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
                    if (labels != X).all():
                        real.append(int(ids[0]))
                    else:  # padding rows carry no label at all
                        assert (labels == X).all()
        assert shapes == {(local, 4)}  # same batch shape and count on every rank
        passes.append(real)
    assert sorted(passes[0]) == list(range(n)) and passes[0] == passes[1]
    # rank r holds chunk c of the order when c % dp == r (the train loader's layout)
    first = next(iter(loaders[-1]))["input_ids"][:, 0].tolist()
    assert first[0] == (dp - 1) * local
    with pytest.raises(ValueError, match="no samples"):
        EvalLoader(Numbers(0), local_batch_size=1, dp_rank=0, dp_size=1)


# -------------------------------------------------------------------------------------- evaluate


def _forward(weight):
    def forward(batch):
        logits = weight[batch["input_ids"]]  # [B, S, V]: a bigram table
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=X, reduction="sum"
        )

    return forward


def test_evaluate_is_the_global_token_mean(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(10, 10)

    class Source:
        def __len__(self):
            return 5

        def get_batch(self, indices):
            idx = np.asarray(indices)
            ids = (idx[:, None] * 3 + np.arange(6)) % 10
            labels = (ids + 1) % 10
            for j, i in enumerate(idx):
                labels[j, : 1 + i % 3] = X  # rows with different valid-token counts
            return {"input_ids": ids, "labels": labels}

    # by hand: every real row of the data, log-softmax looked up, summed, divided by the count
    total, count = 0.0, 0
    for i in range(5):
        batch = Source().get_batch(np.array([i]))
        logp = torch.log_softmax(weight[torch.as_tensor(batch["input_ids"][0])], dim=-1)
        for pos, target in enumerate(batch["labels"][0]):
            if target != X:
                total -= float(logp[pos, target])
                count += 1
    single = evaluate(
        _forward(weight), EvalLoader(Source(), local_batch_size=2, dp_rank=0, dp_size=1), device="cpu"
    )
    assert single["eval_tokens"] == count and single["eval_loss"] == pytest.approx(total / count, rel=1e-6)
    # two ranks: each rank's sums (what the all-reduce adds up) give the same mean
    sums, tokens = 0.0, 0
    for r in range(2):
        part = evaluate(
            _forward(weight), EvalLoader(Source(), local_batch_size=2, dp_rank=r, dp_size=2), device="cpu"
        )
        sums += part["eval_loss"] * part["eval_tokens"]
        tokens += part["eval_tokens"]
    assert tokens == count and sums / tokens == pytest.approx(total / count, rel=1e-6)
    # the reduction goes through the loss group (here a stand-in that doubles every sum)
    import meshforge.utils.distributed as dist_utils

    monkeypatch.setattr(dist_utils, "all_reduce_sum", lambda value, group: value * 2)
    doubled = evaluate(
        _forward(weight),
        EvalLoader(Source(), local_batch_size=2, dp_rank=0, dp_size=1),
        device="cpu",
        loss_group=object(),
    )
    assert doubled["eval_tokens"] == 2 * count and doubled["eval_loss"] == pytest.approx(
        total / count, rel=1e-6
    )
    monkeypatch.undo()
    # max_batches, a forward that counts its own tokens, and no valid token at all
    loader = EvalLoader(Numbers(6), local_batch_size=2, dp_rank=0, dp_size=1)
    calls = []
    out = evaluate(lambda b: (calls.append(1) or torch.tensor(6.0), 3), loader, device="cpu", max_batches=2)
    assert len(calls) == 2 and out == {"eval_loss": 2.0, "eval_tokens": 6.0}
    empty = evaluate(
        lambda b: torch.tensor(0.0),
        [{"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.full((1, 2), X)}],
        device="cpu",
    )
    assert math.isnan(empty["eval_loss"]) and empty["eval_tokens"] == 0


# --------------------------------------------------------------------------------------- Megatron


def _write(path, name, n_docs, seed):
    rng = np.random.default_rng(seed)
    prefix = path / f"{name}_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(n_docs):
            w.add_document(np.r_[rng.integers(1, 1000, int(rng.integers(2, 30))), EOD])
    return str(prefix)


def mg(data_path, split, tmp_path, sizes=None, **extra):
    loader = {
        "type": "BlendedMegatronDatasetDataLoader",
        "config": {
            "seq_length": 16,
            "split": split,
            "eod": EOD,
            "data_path": data_path,
            "path_to_cache": str(tmp_path / "cache"),
        },
    }
    if sizes is not None:
        loader["sizes"] = sizes
    return TrainDatasetConfig.model_validate({"dataloader": loader, **extra})


def test_megatron_valid_split_equals_megatron_core(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gd = pytest.importorskip("megatron.core.datasets.gpt_dataset")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.utils import get_blend_from_list
    import torch.distributed as dist

    class Tok:
        eod, pad, vocab_size = EOD, -1, 1000
        unique_identifiers = {"class": "Tok"}

    a, b = _write(tmp_path, "a", 120, 0), _write(tmp_path, "b", 60, 1)
    cases = [  # (data_path, split, loader sizes, megatron-core sizes)
        ([a], "8,2,0", None, [100, None, 0]),
        ([a, b], "9,1,0", None, [100, None, 0]),
        (["0.3", a, "0.7", b], "9,1,0", [0, 40, 0], [100, 40, 0]),
    ]
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for n, (data_path, split, sizes, ref_sizes) in enumerate(cases):
            ref_cfg = gd.GPTDatasetConfig(
                random_seed=9,
                sequence_length=16,
                blend=get_blend_from_list(data_path),
                split=split,
                tokenizer=Tok(),
                reset_position_ids=False,
                reset_attention_mask=False,
                eod_mask_loss=False,
                create_attention_mask=False,
                path_to_cache=str(tmp_path / f"m{n}"),
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, ref, _ = BlendedMegatronDatasetBuilder(
                    gd.GPTDataset, ref_sizes, lambda: True, ref_cfg
                ).build()
            cfg = mg(data_path, split, tmp_path / f"o{n}", sizes)
            kw = {"tokenizer": None, "local_batch_size": 3, "dp_size": 2, "seed": 9}
            loaders = [build_eval_loader(cfg, LoaderContext(dp_rank=r, **kw)) for r in range(2)]
            assert loaders[0].num_samples == len(ref) >= 10
            # rank r holds chunks r, r + 2, ...: put them back in order and compare sample by sample
            chunks = [[b["input_ids"].numpy() for b in ld] for ld in loaders]
            rows = [row for k in range(len(chunks[0])) for r in range(2) for row in chunks[r][k]][: len(ref)]
            for i in range(len(ref)):
                assert np.array_equal(rows[i], ref[i]["tokens"].numpy()), (n, i)
    finally:
        if own_group:
            dist.destroy_process_group()


def test_megatron_no_valid_split_gives_none(tmp_path):
    a = _write(tmp_path, "a", 40, 0)
    kw = {"tokenizer": None, "local_batch_size": 2, "dp_rank": 0, "dp_size": 1, "seed": 1}
    assert build_eval_loader(mg([a], "1,0,0", tmp_path), LoaderContext(**kw)) is None


# ---------------------------------------------------------------------------------------- epochs


def test_steps_for_epochs():
    assert steps_for_epochs(100, 1, 8, True) == 12  # 4 samples dropped each epoch
    assert steps_for_epochs(100, 2.5, 8, True) == 30
    assert steps_for_epochs(100, 1, 8, False) == 13  # epochs read back to back
    assert steps_for_epochs(100, 3, 8, False) == 38  # ceil(300 / 8)
    assert steps_for_epochs(30, 0.1, 1, True) == 3  # 0.1 * 30 is 3.0000000000000004
    assert steps_for_epochs(10, 0.01, 4, True) == 1
    with pytest.raises(ValueError, match="fewer than one global batch"):
        steps_for_epochs(5, 1, 8, True)


def test_epochs_size_the_run(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 21)
    kw = {"tokenizer": tok, "local_batch_size": 2, "dp_rank": 0, "dp_size": 1, "seed": 0}
    cfg = sft(dataset={"file_name": str(tmp_path / "a.jsonl")}, val_size=5)
    loader = build_train_loader(cfg, LoaderContext(global_batch_size=4, epochs=2.0, **kw))
    assert loader.num_samples == 16 and loader.total_steps == 8
    assert (
        build_train_loader(cfg, LoaderContext(global_batch_size=4, total_steps=5, **kw)).total_steps is None
    )
    # Megatron: one epoch is the train split's samples; the data is then built for steps x batch
    a = _write(tmp_path, "a", 100, 2)
    mcfg = mg([a], "9,1,0", tmp_path)
    lines = []
    loader = build_train_loader(
        mcfg,
        LoaderContext(
            global_batch_size=4,
            epochs=1.5,
            total_steps=1000,
            log=lines.append,
            **{**kw, "tokenizer": None},
        ),
    )
    from meshforge.data.megatron.gpt_dataset import split_document_indices
    from meshforge.data.megatron.indexed import IndexedDataset

    indexed = IndexedDataset(a)
    docs = split_document_indices(len(indexed), "9,1,0")[0]
    per_epoch = (int(indexed.sequence_lengths[docs].sum()) - 1) // 16
    assert loader.total_steps == math.ceil(1.5 * (per_epoch // 4))
    assert loader.dataset.requested_samples == loader.total_steps * 4
    assert any("training.epochs 1.5" in line for line in lines)
    with pytest.raises(ValueError, match=r"sizes\[0\]: fixes the train samples"):
        build_train_loader(
            mg([a], "9,1,0", tmp_path, sizes=[50]),
            LoaderContext(
                global_batch_size=4,
                epochs=1,
                **{**kw, "tokenizer": None},
            ),
        )
