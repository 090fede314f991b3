"""GPTDataset: Megatron's split, epochs, indices and samples; the cache; the batch-contract fields."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from meshforge.data.megatron.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    build_document_index,
    build_sample_index,
    num_epochs_needed,
    parse_split,
    split_document_indices,
)
from meshforge.data.megatron.indexed import IndexedDataset, IndexedDatasetWriter

EOD = 0


def _corpus(path, n_docs=120, seed=0, max_len=40, empty_every=0):
    rng = np.random.default_rng(seed)
    prefix = path / "corpus_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(n_docs):
            if empty_every and i % empty_every == 3:
                w.add_document([])
                continue
            n = int(rng.integers(1, max_len))
            w.add_document(np.concatenate([rng.integers(1, 1000, n), [EOD]]))
    return IndexedDataset(prefix)


def _walk(sizes, doc_idx, seq, epochs, tpe, drop_last=True, extra=1):
    """Line-by-line transcription of Megatron's C++ build_sample_idx (megatron-core's helpers.cpp)."""
    total = epochs * tpe - extra
    n = total // seq if drop_last else -(-total // seq)
    out = [(0, 0)]
    i = off = 0
    while len(out) <= n:
        rem = seq + extra
        while rem != 0:
            length = sizes[doc_idx[i]] - off
            rem -= length
            if rem <= 0:
                off += rem + length - extra
                rem = 0
            else:
                if i == len(doc_idx) - 1:
                    off = sizes[doc_idx[i]] - extra
                    break
                i += 1
                off = 0
        out.append((i, off))
    return np.array(out)


def test_parse_split_and_document_ranges():
    assert parse_split("1,0,0") == [1.0, 0.0, 0.0]
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("3") == [1.0, 0.0, 0.0]
    train, valid, test = split_document_indices(10, "8,2,0")
    assert train.tolist() == list(range(8)) and valid.tolist() == [8, 9] and test is None
    assert train.dtype == np.int32
    with pytest.raises(ValueError, match="split"):
        parse_split("0,0,0")


def test_epochs_rule():
    assert num_epochs_needed(100, None, 10, 1) == 1
    assert num_epochs_needed(100, 9, 10, 1) == 1  # 91 tokens
    assert num_epochs_needed(100, 10, 10, 1) == 2  # 101 tokens
    assert num_epochs_needed(100, 10, 10, 0) == 1


@pytest.mark.parametrize(
    ("seq", "epochs", "drop_last", "extra", "empty"),
    [(8, 1, True, 1, 0), (5, 3, True, 1, 4), (7, 2, False, 1, 0), (6, 2, True, 0, 5), (9, 1, False, 0, 0)],
)
def test_sample_index_equals_the_sequential_walk(tmp_path, seq, epochs, drop_last, extra, empty):
    ds = _corpus(tmp_path, n_docs=30, max_len=12, empty_every=empty)
    sizes = ds.sequence_lengths
    docs = np.arange(len(ds), dtype=np.int32)
    doc_idx = build_document_index(docs, epochs, np.random.RandomState(3), separate_final_epoch=epochs > 2)
    tpe = int(sizes.sum())
    got = build_sample_index(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)
    assert np.array_equal(got, _walk(sizes, doc_idx, seq, epochs, tpe, drop_last, extra))
    assert got.dtype == np.int32


def test_samples_cover_the_stream_sharing_one_token(tmp_path):
    ds = _corpus(tmp_path)
    cfg = GPTDatasetConfig(seq_length=16, seed=1, eod=EOD, path_to_cache=str(tmp_path / "cache"))
    gpt = GPTDataset(ds, np.arange(len(ds), dtype=np.int32), None, cfg)
    stream = np.concatenate([ds[int(d)] for d in gpt.document_index]).astype(np.int64)
    order = np.argsort(gpt.shuffle_index)  # unshuffle: sample j of the stream
    for j in range(len(gpt)):
        text = gpt.text(int(order[j]))
        assert np.array_equal(text, stream[j * 16 : j * 16 + 17])


def _megatron_gpt(tmp_path, prefix, seq, sizes, split, **flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gd = pytest.importorskip("megatron.core.datasets.gpt_dataset")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    class Tok:
        eod, pad, vocab_size = EOD, -1, 1000
        unique_identifiers = {"class": "Tok"}

    cfg = gd.GPTDatasetConfig(
        random_seed=7,
        sequence_length=seq,
        blend=([prefix], None),
        split=split,
        tokenizer=Tok(),
        path_to_cache=str(tmp_path / "mcache"),
        **flags,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(gd.GPTDataset, sizes, lambda: True, cfg).build()


@pytest.mark.parametrize(
    ("seq", "sizes", "split", "flags"),
    [
        (32, [50, 0, 0], "1,0,0", {}),
        (32, [900, 300, 0], "8,2,0", {"eod_mask_loss": True}),  # several epochs, a separate last one
        (16, [400, 100, 60], "6,3,1", {"reset_position_ids": True, "reset_attention_mask": True}),
    ],
)
def test_indices_and_samples_equal_megatron_core(tmp_path, seq, sizes, split, flags):
    ds = _corpus(tmp_path)
    full = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    full.update(flags)
    theirs = _megatron_gpt(tmp_path, ds.prefix, seq, sizes, split, create_attention_mask=True, **full)
    cfg = GPTDatasetConfig(
        seq_length=seq, seed=7, eod=EOD, create_attention_mask=True, path_to_cache=str(tmp_path / "o"), **full
    )
    for k, (m, docs) in enumerate(zip(theirs, split_document_indices(len(ds), split), strict=True)):
        assert (m is None) == (docs is None)
        if m is None:
            continue
        ours = GPTDataset(ds, docs, sizes[k], cfg, split=("train", "valid", "test")[k])
        for name in ("document_index", "sample_index", "shuffle_index"):
            a, b = getattr(m, name), getattr(ours, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        for i in range(len(ours)):
            mine, ref = ours.sample(i), m[i]
            assert sorted(mine) == sorted(ref)
            for key, value in ref.items():
                assert np.array_equal(value.numpy(), mine[key]), (key, i)


def _gpt(tmp_path, docs_tokens, seq, **kw):
    prefix = tmp_path / "small_text_document"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in docs_tokens:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(seq_length=seq, seed=0, eod=EOD, **kw)
    return GPTDataset(ds, np.arange(len(ds), dtype=np.int32), None, cfg)


def test_contract_fields_separate_documents(tmp_path):
    # One document order; every sample sees 3 documents [5 6 EOD][7 8 9 EOD][10 11 ...].
    docs = [[5, 6, EOD], [7, 8, 9, EOD], [10, 11, 12, 13, 14, 15, 16, 17, 18, EOD]]
    gpt = _gpt(tmp_path, docs, 12, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    j = int(np.flatnonzero(np.asarray(gpt.shuffle_index) == 0)[0])
    text = gpt.text(j)
    row = gpt.contract_sample(j)
    tokens = text[:12]
    eods = np.flatnonzero(tokens == EOD)
    expected_seg = np.ones(12, dtype=np.int64)
    expected_pos = np.arange(12)
    for e in eods:
        expected_seg[e + 1 :] += 1
        expected_pos[e + 1 :] = np.arange(12 - e - 1)
    assert np.array_equal(row["input_ids"], tokens)
    assert np.array_equal(row["segment_ids"], expected_seg)
    assert np.array_equal(row["position_ids"], expected_pos)
    labels = text[1:].copy()
    labels[tokens == EOD] = -100  # eod_mask_loss: no loss where the input is EOD
    assert np.array_equal(row["labels"], labels)
    batch = gpt.get_batch(np.array([j, j]))
    assert batch["segment_ids"].shape == (2, 12)


def test_attention_mask_and_compressed_eod_mask(tmp_path):
    docs = [[5, 6, EOD], [7, 8, 9, EOD], [10, 11, 12, 13, EOD]]
    gpt = _gpt(
        tmp_path,
        docs,
        8,
        reset_attention_mask=True,
        create_attention_mask=True,
        create_compressed_eod_mask=True,
        eod_pad_length=4,
    )
    s = gpt.sample(0)
    tokens = s["tokens"]
    ends = [int(e) + 1 for e in np.flatnonzero(tokens == EOD) if e < 7]
    assert s["actual_seq_len"].tolist() == ends + [8] * (4 - len(ends))
    mask = s["attention_mask"][0]  # True = masked
    doc = np.cumsum(np.r_[0, (tokens == EOD)[:-1]])
    allowed = np.tril(np.ones((8, 8), bool)) & (doc[:, None] == doc[None, :])
    assert np.array_equal(mask, ~allowed)
    many = _gpt(tmp_path / "m", [[1, EOD]] * 10, 8, create_compressed_eod_mask=True, eod_pad_length=2)
    with pytest.raises(ValueError, match="eod_pad_length=2"):
        many.sample(0)


def test_valid_partial_sample_is_padded_and_masked(tmp_path):
    docs = [[5, 6, 7, EOD], [8, 9, EOD]]  # 7 tokens, seq 4: one full sample and a partial one
    prefix = tmp_path / "p_text_document"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(
        seq_length=4,
        seed=0,
        eod=EOD,
        pad=-1,
        reset_attention_mask=True,
        drop_last_partial_validation_sequence=False,
    )
    gpt = GPTDataset(ds, np.arange(2, dtype=np.int32), None, cfg, split="valid")
    assert len(gpt) == 2
    rows = [gpt.contract_sample(i) for i in range(2)]
    partial = next(r for r in rows if (r["labels"] == -100).any())
    assert partial["segment_ids"][-1] == 0 and partial["segment_ids"][0] > 0  # the pad is segment 0
    assert int((partial["labels"] != -100).sum()) == 2  # 7 tokens = 4 + 1 shared + 2 more targets


def test_cache_reused_and_rebuilt_when_description_changes(tmp_path):
    ds = _corpus(tmp_path)
    docs = np.arange(len(ds), dtype=np.int32)
    cfg = GPTDatasetConfig(seq_length=16, seed=1, eod=EOD)
    first = GPTDataset(ds, docs, 100, cfg)
    folder = tmp_path / "cache" / "GPTDataset_indices"
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) == 4 and all(f.startswith(first.description_hash + "-GPTDataset-train-") for f in files)
    logs = []
    again = GPTDataset(ds, docs, 100, cfg, log=logs.append)
    assert "loaded cached" in logs[0] and np.array_equal(again.shuffle_index, first.shuffle_index)
    GPTDataset(ds, docs, 100, GPTDatasetConfig(seq_length=16, seed=2, eod=EOD))
    assert len(list(folder.iterdir())) == 8


def test_other_ranks_wait_for_rank_zero(tmp_path):
    ds = _corpus(tmp_path)
    docs = np.arange(len(ds), dtype=np.int32)
    cfg = GPTDatasetConfig(seq_length=16, seed=1, eod=EOD, path_to_cache=str(tmp_path / "c"))
    calls = []
    with pytest.raises(FileNotFoundError, match="rank 0 did not write"):
        GPTDataset(ds, docs, 50, cfg, rank=1, barrier=lambda: calls.append(1))
    assert calls == [1]
    GPTDataset(ds, docs, 50, cfg, rank=0, barrier=lambda: calls.append(0))
    late = GPTDataset(ds, docs, 50, cfg, rank=1, barrier=lambda: calls.append(1))
    assert calls == [1, 0, 1] and len(late) >= 50


def _loader_samples(tmp_path, prefix, seq, steps, seed):
    """The input_ids meshforge trains on for `steps` steps of one sample (sizes unset), in order."""
    from meshforge.data.build import LoaderContext, build_train_loader
    from meshforge.data.config import TrainDatasetConfig

    cfg = TrainDatasetConfig.model_validate(
        {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "config": {
                    "seq_length": seq,
                    "eod": EOD,
                    "seed": seed,
                    "data_path": [str(prefix)],
                    "path_to_cache": str(tmp_path / f"ours-{steps}"),
                },
            }
        }
    )
    ctx = LoaderContext(
        tokenizer=None,
        local_batch_size=1,
        dp_rank=0,
        dp_size=1,
        seed=0,
        global_batch_size=1,
        total_steps=steps,
    )
    loader = build_train_loader(cfg, ctx)
    return [next(loader)["input_ids"][0].numpy() for _ in range(steps)], len(loader.dataset)


@pytest.mark.parametrize(
    ("docs", "seq"),
    [
        ([65], 64),  # one document of exactly seq_length + 1 tokens, no EOD: one sample per epoch
        ([33, 32], 32),  # two documents, exactly one epoch of two samples
        ([40, 25], 16),  # a remainder at the end of the epoch
    ],
)
def test_loader_samples_at_the_epoch_boundary_equal_megatron_core(tmp_path, docs, seq):
    prefix = tmp_path / "tiny_text_document"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        start = 1
        for n in docs:
            w.add_document(np.arange(start, start + n))  # no EOD token in the data
            start += n
    per_epoch = (sum(docs) - 1) // seq
    for steps in sorted({1, per_epoch, per_epoch + 1}):
        flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
        theirs = _megatron_gpt(tmp_path / f"mc-{steps}", str(prefix), seq, [steps, 0, 0], "1,0,0", **flags)[0]
        ours, size = _loader_samples(tmp_path, prefix, seq, steps, seed=7)
        assert size == len(theirs), (steps, size, len(theirs))
        for i in range(steps):
            assert np.array_equal(ours[i], theirs[i]["tokens"].numpy()), (steps, i)
    # the one-epoch case reads the corpus from its first token
    ours, _ = _loader_samples(tmp_path, prefix, seq, per_epoch, seed=7)
    first_epoch = sorted(int(row[0]) for row in ours)
    assert first_epoch == [1 + k * seq for k in range(per_epoch)]
