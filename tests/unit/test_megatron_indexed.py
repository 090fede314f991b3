"""Megatron indexed .bin/.idx files: round trip, the documented byte layout, megatron-core's reader/writer."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from meshforge.data.megatron.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    optimal_dtype,
)


def _docs(seed: int = 0, n: int = 40, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, 30))) for _ in range(n)]


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_round_trip_and_slices(tmp_path):
    docs = _docs()
    prefix = tmp_path / "sub" / "c_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.uint16
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
        if len(d) >= 5:
            assert np.array_equal(ds.get(i, 2, 3), d[2:5])
            assert np.array_equal(ds.get(i, 3), d[3:])
    assert np.array_equal(ds.document_indices, np.arange(len(docs) + 1))
    with pytest.raises(IndexError, match="out of sequence"):
        ds.get(0, 0, len(docs[0]) + 1)


def test_idx_layout_byte_by_byte(tmp_path):
    # Two documents, the second of two sentences: header, lengths, pointers, document indices.
    prefix = tmp_path / "x"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_document([5, 6, 7])
        w.add_item([8])
        w.add_item([9, 10])
        w.end_document()
    raw = (tmp_path / "x.idx").read_bytes()
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 4)  # int32
        + struct.pack("<Q", 3)  # sequences
        + struct.pack("<Q", 3)  # documents + 1
        + np.array([3, 1, 2], dtype=np.int32).tobytes()
        + np.array([0, 12, 16], dtype=np.int64).tobytes()  # byte offsets
        + np.array([0, 1, 3], dtype=np.int64).tobytes()
    )
    assert raw == expected
    assert (tmp_path / "x.bin").read_bytes() == np.arange(5, 11, dtype=np.int32).tobytes()


def test_optimal_dtype_and_codes(tmp_path):
    assert optimal_dtype(65499) is np.uint16 and optimal_dtype(65500) is np.int32
    for dtype, code in [(np.uint8, 1), (np.int16, 3), (np.int64, 5), (np.uint16, 8)]:
        prefix = tmp_path / f"d{code}"
        with IndexedDatasetWriter(prefix, dtype) as w:
            w.add_document([1, 2, 3])
        assert (tmp_path / f"d{code}.idx").read_bytes()[17] == code
        assert IndexedDataset(prefix).dtype == np.dtype(dtype)
    with pytest.raises(ValueError, match="out of range"):
        IndexedDatasetWriter(tmp_path / "small", np.uint8).add_item([300])


def test_reader_rejects_foreign_and_truncated_files(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ok", np.uint16) as w:
        w.add_document([1, 2, 3])
    raw = (tmp_path / "ok.idx").read_bytes()
    (tmp_path / "bad.bin").write_bytes(b"")
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX!" + raw[9:])
    with pytest.raises(ValueError, match="not a Megatron .idx"):
        IndexedDataset(tmp_path / "bad")
    (tmp_path / "bad.idx").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        IndexedDataset(tmp_path / "missing")


def test_merge_shards(tmp_path):
    docs = _docs(1, 10)
    for name, part in (("a", docs[:4]), ("b", docs[4:])):
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as w:
            for d in part:
                w.add_document(d)
    with IndexedDatasetWriter(tmp_path / "all", np.uint16) as w:
        w.add_index(tmp_path / "a")
        w.add_index(tmp_path / "b")
    with IndexedDatasetWriter(tmp_path / "direct", np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"all.{ext}").read_bytes() == (tmp_path / f"direct.{ext}").read_bytes()


def test_bytes_equal_megatron_core_writer_and_reader(tmp_path):
    mi = _megatron()
    docs = [d for d in _docs(2) if len(d)]
    builder = mi.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(d.astype(np.int64), [len(d)])  # it only needs numpy.array(x)
    builder.finalize(str(tmp_path / "m.idx"))
    with IndexedDatasetWriter(tmp_path / "o", np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"o.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes()
    theirs = mi.IndexedDataset(str(tmp_path / "o"))
    assert len(theirs) == len(docs)
    for i, d in enumerate(docs):
        assert np.array_equal(theirs[i], d)
        assert np.array_equal(
            theirs.get(i, 1, len(d) - 1), IndexedDataset(tmp_path / "o").get(i, 1, len(d) - 1)
        )
