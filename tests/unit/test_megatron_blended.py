"""Blend lists, the deterministic weighting, the surplus rule, the oversample error, megatron-core parity."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from meshforge.data.megatron.blended import (
    BlendedDataset,
    blending_indices,
    build_datasets,
    exhaustive_blending_indices,
    member_sizes,
    parse_blend,
)
from meshforge.data.megatron.gpt_dataset import GPTDataset, GPTDatasetConfig
from meshforge.data.megatron.indexed import IndexedDataset, IndexedDatasetWriter

EOD = 0


def _write(path, name, n_docs, seed):
    rng = np.random.default_rng(seed)
    prefix = path / f"{name}_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(n_docs):
            w.add_document(np.r_[rng.integers(1, 1000, int(rng.integers(1, 30))), EOD])
    return str(prefix)


def test_parse_blend_forms_and_quirk():
    assert parse_blend(["a", "b", "c"]).weights is None
    blend = parse_blend(["30", " a ", 70, "b"])
    assert blend.prefixes == ["a", "b"] and blend.weights == [30.0, 70.0]
    assert parse_blend(["1", "p"]).weights == [1.0]
    # Megatron's iterator reuse: from the first non-number on, every weight slot must be a non-number.
    assert parse_blend(["0.5", "a", "b", "c"]).prefixes == ["0.5", "a", "b", "c"]
    assert parse_blend(["x", "a", "y", "b"]).weights is None
    with pytest.raises(ValueError, match=r"data_path\[2\]: '0.5' is a weight but data_path\[0\]"):
        parse_blend(["x", "a", "0.5", "b"])
    with pytest.raises(ValueError, match=r"data_path\[2\]: a blend weight must be a positive"):
        parse_blend(["1", "a", "0", "b"])


def test_weighting_is_deterministic_argmax_of_error():
    members, numbers = blending_indices([0.5, 0.3, 0.2], 10)
    assert members.dtype == np.int16 and numbers.dtype == np.int64
    # Worked by hand: s=0 and s=1 both scale by 1, errors (.5,.3,.2) -> 0, then (-.5,.3,.2) -> 1,
    # s=2: (0,-.4,.4) -> 2, s=3: (.5,-.1,-.4) -> 0, s=4: (0,.2,-.2) -> 1, s=5: (.5,-.5,0) -> 0, ...
    assert members.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert numbers.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]
    big, _ = blending_indices([0.7, 0.3], 10_000)
    assert abs(int((big == 0).sum()) - 7000) <= 1
    members, numbers = exhaustive_blending_indices([3, 1])
    assert sorted(zip(members.tolist(), numbers.tolist(), strict=True)) == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_surplus_rule():
    assert member_sizes([0.3, 0.7], 1000) == [300, 700]
    assert member_sizes([0.3, 0.7], 1000, 0.005) == [302, 704]  # ceil(ceil(size*w)*1.005)
    assert member_sizes([1 / 3, 2 / 3], 10, 0.005) == [5, 8]


def test_oversampling_names_the_weight(tmp_path):
    small = IndexedDataset(_write(tmp_path, "small", 5, 0))
    big = IndexedDataset(_write(tmp_path, "big", 50, 1))
    cfg = GPTDatasetConfig(seq_length=8, seed=0, eod=EOD)
    docs = [np.arange(len(d), dtype=np.int32) for d in (small, big)]
    members = [GPTDataset(d, i, None, cfg) for d, i in zip((small, big), docs, strict=True)]
    with pytest.raises(IndexError, match=r"oversamples data_path member 0 .*small_text_document, weight 0.5"):
        BlendedDataset(members, [1, 1], 4 * len(members[0]), prefixes=[small.prefix, big.prefix])


def test_blend_sizes_and_cache(tmp_path):
    a, b = _write(tmp_path, "a", 60, 0), _write(tmp_path, "b", 30, 1)
    cfg = GPTDatasetConfig(seq_length=8, seed=3, eod=EOD)
    train, valid, test = build_datasets(["0.25", a, "0.75", b], "9,1,0", [400, 40, None], cfg)
    assert test is None and isinstance(train, BlendedDataset)
    assert len(train) == 100 + 300 and len(valid) == 10 + 30
    assert [len(m) >= n for m, n in zip(train.datasets, [101, 302], strict=True)] == [True, True]
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [100, 300]
    cached = sorted(
        p.name for p in (tmp_path / "cache" / "GPTDataset_indices").glob("*BlendedDataset-train*")
    )
    assert len(cached) == 3
    batch = train.get_batch(np.arange(4))
    assert batch["input_ids"].shape == (4, 8) and set(batch) == {"input_ids", "labels", "position_ids"}
    # A lone prefix is a bare GPTDataset; prefixes only are weighted by their lengths.
    [single, _, _] = build_datasets([a], "1,0,0", [50], cfg)
    assert isinstance(single, GPTDataset) and len(single) >= 50
    [by_length, _, _] = build_datasets([a, b], "1,0,0", [None], cfg)
    assert len(by_length) == sum(len(m) for m in by_length.datasets)


def test_equal_to_megatron_core(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gd = pytest.importorskip("megatron.core.datasets.gpt_dataset")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.utils import get_blend_from_list
    import torch.distributed as dist

    class Tok:
        eod, pad, vocab_size = EOD, -1, 1000
        unique_identifiers = {"class": "Tok"}

    prefixes = [_write(tmp_path, name, n, i) for i, (name, n) in enumerate([("a", 80), ("b", 20), ("c", 50)])]
    cases = [
        (["0.3", prefixes[0], "0.5", prefixes[1], "0.2", prefixes[2]], "9,1,0", [600, 30, 0]),
        (prefixes, "8,2,0", [200, None, None]),
    ]
    # megatron-core's BlendedDataset asks torch.distributed for the rank: give it a 1-process group.
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for n, (data_path, split, sizes) in enumerate(cases):
            ref_cfg = gd.GPTDatasetConfig(
                random_seed=5,
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
                theirs = BlendedMegatronDatasetBuilder(gd.GPTDataset, sizes, lambda: True, ref_cfg).build()
            ours = build_datasets(
                data_path,
                split,
                sizes,
                GPTDatasetConfig(seq_length=16, seed=5, eod=EOD, path_to_cache=str(tmp_path / f"o{n}")),
            )
            for m, o in zip(theirs, ours, strict=True):
                assert (m is None) == (o is None)
                if m is None:
                    continue
                assert len(m) == len(o)
                assert np.array_equal(m.dataset_index, o.dataset_index)
                assert np.array_equal(m.dataset_sample_index, o.dataset_sample_index)
                for i in range(0, len(o), 7):
                    ref, mine = m[i], o.sample(i)
                    assert int(ref["dataset_id"]) == mine["dataset_id"]
                    assert np.array_equal(ref["tokens"].numpy(), mine["tokens"])
    finally:
        if own_group:
            dist.destroy_process_group()
