"""SFT `streaming: true`: shuffle-buffer order, validation held out, DP sharding, exact resume."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.data.build import LoaderContext, build_eval_loader, build_train_loader  # noqa: E402
from meshforge.data.config import TrainDatasetConfig  # noqa: E402
from meshforge.data.loader import StreamLoader  # noqa: E402
from meshforge.data.sft.loader import SFTStream, build_sft_data  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402

X = -100
N = 22


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "a.jsonl"
    rows = [{"instruction": f"q{i} please", "input": "", "output": f"answer {i}"} for i in range(N)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def cfg(data, **fields):
    return TrainDatasetConfig.model_validate(
        {
            "dataloader": {"type": "SFTDataLoader"},
            "template": "chatml",
            "cutoff_len": 40,
            "dataset": {"file_name": data},
            "streaming": True,
            "buffer_size": 6,
            "preprocessing_batch_size": 5,
            **fields,
        }
    )


def number(tok, ids):
    return int(re.search(r"q(\d+) please", tok.decode(ids)).group(1))


def numbers(tok, batch):
    """Example numbers of the real rows of a batch (rows with some label)."""
    return [
        number(tok, ids)
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
        if (labels != X).any()
    ]


def loaders(c, tok, *, dp, local=2, gbs=4, seed=5):
    return [
        build_train_loader(
            c,
            LoaderContext(
                tokenizer=tok,
                local_batch_size=local,
                dp_rank=r,
                dp_size=dp,
                seed=seed,
                global_batch_size=gbs,
            ),
        )
        for r in range(dp)
    ]


def test_stream_order_is_seeded_and_reshuffled_per_epoch(data, tok):
    stream, valid = build_sft_data(cfg(data), tok, seed=5)
    assert isinstance(stream, SFTStream) and valid is None
    epoch0 = [number(tok, r["input_ids"]) for r in stream.rows(0)]
    epoch1 = [number(tok, r["input_ids"]) for r in stream.rows(1)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(N))
    assert epoch0 != list(range(N)) and epoch0 != epoch1  # shuffled, differently each epoch
    # the same seed and epoch give the same order; the buffer bounds how far a row can move ahead
    assert [number(tok, r["input_ids"]) for r in stream.rows(0)] == epoch0
    assert all(pos >= n - 6 for pos, n in enumerate(epoch0))  # a buffer of 6 lets a row move at most 6 ahead
    other, _ = build_sft_data(cfg(data), tok, seed=6)
    assert [number(tok, r["input_ids"]) for r in other.rows(0)] != epoch0
    # batches are padded to cutoff_len with labels shifted, as for in-memory rows
    row = next(stream.rows(0))
    batch = stream.collate([row])
    n = len(row["input_ids"])
    assert batch["input_ids"].shape == (1, 40) and (batch["labels"][0, : n - 1] == row["labels"][1:]).all()


def test_validation_is_the_head_of_the_stream_and_never_trained_on(data, tok):
    c = cfg(data, val_size=4)
    stream, valid = build_sft_data(c, tok, seed=5)
    full, _ = build_sft_data(cfg(data), tok, seed=5)
    head = [number(tok, r["input_ids"]) for r in full.rows(0)]
    held = [number(tok, valid.row(i)["input_ids"]) for i in range(len(valid))]
    # LLaMA-Factory: validation = shuffled.take(4), train = shuffled.skip(4)
    assert held == head[:4]
    assert [number(tok, r["input_ids"]) for r in stream.rows(0)] == head[4:]
    later = [number(tok, r["input_ids"]) for r in stream.rows(1)]
    assert sorted(later) == sorted(head[4:])  # a reshuffled epoch still leaves the validation out
    kw = {"tokenizer": tok, "local_batch_size": 3, "dp_size": 1, "dp_rank": 0, "seed": 5}
    ev = build_eval_loader(c, LoaderContext(**kw))
    assert ev.num_samples == 4 and sorted(n for b in ev for n in numbers(tok, b)) == sorted(held)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_dp_sharding_and_resume_match_the_uninterrupted_run(data, tok, drop_remainder):
    c = cfg(data, val_size=2, drop_remainder=drop_remainder)  # 20 train rows: 5 steps of 4 per epoch
    steps = 13  # crosses two epoch ends
    [single] = loaders(c, tok, dp=1)
    assert isinstance(single, StreamLoader) and single.num_samples is None
    run = [numbers(tok, next(single)) + numbers(tok, next(single)) for _ in range(steps)]
    pair = loaders(c, tok, dp=2)
    # rank r reads chunk r of every step: two ranks together see the one-rank steps
    for step in range(steps):
        parts = [numbers(tok, next(ld)) for ld in pair]
        assert parts[0] + parts[1] == run[step]
    epoch0 = [n for step in run[:5] for n in step]
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 20
    # resume at 1 and 2 ranks from a state taken after 7 steps (in the second epoch)
    for dp in (1, 2):
        part = loaders(c, tok, dp=dp)
        for _ in range(7):
            for ld in part:
                for _ in range(2 // dp):
                    next(ld)
        state = part[0].state_dict()
        assert state == part[-1].state_dict() and state["epoch"] == 1
        resumed = loaders(c, tok, dp=dp)
        for ld in resumed:
            ld.load_state_dict(state)
        for step in range(7, steps):
            got = [n for _ in range(2 // dp) for ld in resumed for n in numbers(tok, next(ld))]
            assert got == run[step], (dp, step)


def test_remainder_dropped_or_carried_over(data, tok):
    # 22 rows, global batch 4: 2 rows dropped at each epoch end, or carried into a mixed step
    [dropping] = loaders(cfg(data, drop_remainder=True), tok, dp=1, local=4, gbs=4)
    seen = [numbers(tok, next(dropping)) for _ in range(6)]
    assert dropping.dropped_rows == 2 and dropping.epoch == 1
    assert len({n for s in seen[:5] for n in s}) == 20 and len(set(seen[5])) == 4
    [keeping] = loaders(cfg(data, drop_remainder=False), tok, dp=1, local=4, gbs=4)
    flat = [n for _ in range(11) for n in numbers(tok, next(keeping))]
    assert sorted(flat[:22]) == list(range(N)) and sorted(flat[22:]) == list(range(N))
    assert keeping.dropped_rows == 0
    # a state taken inside a step (after 3 micro-batches of 2 in steps of 4) resumes inside it
    c = cfg(data, drop_remainder=False)
    [ref] = loaders(c, tok, dp=1)
    expected = [numbers(tok, next(ref)) for _ in range(6)]
    [part] = loaders(c, tok, dp=1)
    for _ in range(3):
        next(part)
    assert part.state_dict()["rounds"] == 1
    [resumed] = loaders(c, tok, dp=1)
    resumed.load_state_dict(part.state_dict())
    assert [numbers(tok, next(resumed)) for _ in range(3)] == expected[3:]


def test_streaming_packing_and_refusals(data, tok, tmp_path):
    [packed] = loaders(cfg(data, packing=True, neat_packing=True, cutoff_len=96), tok, dp=1, local=1, gbs=1)
    batch = next(packed)
    assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert int(batch["segment_ids"].max()) >= 2  # several examples per row
    kw = {
        "tokenizer": tok,
        "local_batch_size": 2,
        "dp_rank": 0,
        "dp_size": 1,
        "seed": 0,
        "global_batch_size": 2,
    }
    with pytest.raises(ValueError, match=r"training\.epochs: the length of this data is not known"):
        build_train_loader(cfg(data, val_size=1), LoaderContext(epochs=1.0, **kw))
    with pytest.raises(ValueError, match=r"tokenized_path: cannot be combined with streaming"):
        build_sft_data(cfg(data, tokenized_path=str(tmp_path / "t")), tok, seed=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"train_dataset\.dataset .*empty\.jsonl\): has no records"):
        build_sft_data(cfg(str(tmp_path / "empty.jsonl")), tok, seed=0)
    # a state of the in-memory loader is not taken for a stream, and the other way round
    [stream] = loaders(cfg(data), tok, dp=1)
    plain = build_train_loader(cfg(data, streaming=False), LoaderContext(**kw))
    with pytest.raises(ValueError, match="non-streaming loader"):
        stream.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="streaming loader"):
        plain.load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match="seed was"):
        stream.load_state_dict({**stream.state_dict(), "seed": 1})
    # a stream shorter than one global batch
    [small] = loaders(cfg(data, drop_remainder=True), tok, dp=1, local=8, gbs=24)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        next(small)
    assert np.all(np.asarray(next(iter(stream))["input_ids"].shape) == [2, 40])


def test_broken_records_of_a_stream_are_counted_and_reported(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    rows = [{"instruction": f"q{i} please", "input": "", "output": f"answer {i}"} for i in range(6)]
    rows += [
        {"instruction": "", "input": "", "output": "no prompt"},
        {"instruction": "", "output": "none"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines: list[str] = []
    stream, _ = build_sft_data(cfg(str(path)), tok, seed=5, log=lines.append)
    kept = [number(tok, r["input_ids"]) for r in stream.rows(0)]
    assert sorted(kept) == list(range(6))
    report = [line for line in lines if "sft stream epoch 0: skipped 2 broken record(s)" in line]
    assert report, lines
