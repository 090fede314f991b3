"""StatefulLoader order, DP sharding, resume and epochs; build_train_loader dispatch and notes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from meshforge.data.build import LoaderContext, build_train_loader
from meshforge.data.config import TrainDatasetConfig
from meshforge.data.loader import StatefulLoader
from meshforge.data.options import LoaderOptions
from meshforge.data.specs import LOADERS, LoaderKind, register_loader

SEQ = 3


class IdDataset:
    """Sample i is [i*100, i*100+1, ...]: the sample id can be read back from any batch row."""

    def __init__(self, n: int, extra: dict | None = None):
        self.n, self.calls, self.extra = n, 0, extra or {}

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        self.calls += 1
        rows = np.asarray(indices)[:, None] * 100 + np.arange(SEQ + 1)
        return {
            "input_ids": rows[:, :-1],
            "labels": rows[:, 1:],
            **{k: f(indices) for k, f in self.extra.items()},
        }


def ids_of(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // 100).tolist()


def make_loaders(
    n: int, *, dp: int, local: int, gbs: int | None = None, seed: int = 3, shuffle: bool = True, **kw
):
    ds = IdDataset(n)
    return [
        StatefulLoader(
            ds,
            local_batch_size=local,
            dp_rank=r,
            dp_size=dp,
            seed=seed,
            shuffle=shuffle,
            global_batch_size=gbs,
            **kw,
        )
        for r in range(dp)
    ]


def step_samples(loaders: list[StatefulLoader], grad_accum: int) -> list[int]:
    """All samples one optimizer step reads: every rank draws grad_accum micro-batches."""
    out: list[int] = []
    for _ in range(grad_accum):
        for loader in loaders:
            out.extend(ids_of(next(loader)))
    return out


def test_batch_contract():
    [loader] = make_loaders(10, dp=1, local=4)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels"}
    for value in batch.values():
        assert value.dtype == torch.long and value.device.type == "cpu" and value.shape == (4, SEQ)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    with_pos = StatefulLoader(
        IdDataset(10, {"position_ids": lambda idx: np.tile(np.arange(SEQ), (len(idx), 1))}),
        local_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
        shuffle=False,
    )
    assert torch.equal(next(with_pos)["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 2]]))
    bad = StatefulLoader(
        IdDataset(10, {"mask": lambda idx: idx}),
        local_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
        shuffle=False,
    )
    with pytest.raises(KeyError, match="unknown"):
        next(bad)


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize(("dp", "local"), [(2, 4), (2, 2), (4, 1), (8, 1)])
def test_step_union_independent_of_dp(dp, local, drop_remainder):
    n, gbs = 45, 8  # 45 is not a multiple of 8: epochs roll over mid-way and drop or wrap
    single = make_loaders(n, dp=1, local=8, gbs=gbs, drop_remainder=drop_remainder)
    multi = make_loaders(n, dp=dp, local=local, gbs=gbs, drop_remainder=drop_remainder)
    for _ in range(20):  # several epochs
        one = step_samples(single, 1)
        many = step_samples(multi, gbs // (dp * local))
        assert sorted(one) == sorted(many)
        assert len(set(many)) == gbs or not drop_remainder  # a step never repeats a sample within an epoch
    assert single[0].state_dict() == multi[0].state_dict() == multi[-1].state_dict()


def test_ranks_read_disjoint_consecutive_chunks():
    r0, r1 = make_loaders(20, dp=2, local=3, shuffle=False)
    assert ids_of(next(r0)) == [0, 1, 2] and ids_of(next(r1)) == [3, 4, 5]
    assert ids_of(next(r0)) == [6, 7, 8] and ids_of(next(r1)) == [9, 10, 11]


def test_shuffle_order_depends_only_on_seed_and_epoch():
    n = 50
    [a] = make_loaders(n, dp=1, local=5, seed=11)
    [b] = make_loaders(n, dp=1, local=5, seed=11)
    [c] = make_loaders(n, dp=1, local=5, seed=12)
    first = [ids_of(next(a)) for _ in range(10)]
    assert first == [ids_of(next(b)) for _ in range(10)]
    assert first != [ids_of(next(c)) for _ in range(10)]
    flat = [i for chunk in first for i in chunk]
    # the documented order: a permutation drawn from (seed, epoch), whatever the batch layout
    np.testing.assert_array_equal(flat, np.random.default_rng([11, 0]).permutation(n))
    assert sorted(flat) == list(range(n))
    second = [i for _ in range(10) for i in ids_of(next(a))]
    np.testing.assert_array_equal(second, np.random.default_rng([11, 1]).permutation(n))
    assert second != flat and a.epoch == 2
    r0, r1 = make_loaders(n, dp=2, local=5, seed=11)
    layout = [i for _ in range(5) for loader in (r0, r1) for i in ids_of(next(loader))]
    assert layout == flat


def test_epoch_rollover_drop_remainder_counts():
    [loader] = make_loaders(45, dp=1, local=4, gbs=8, shuffle=False)
    assert (loader.samples_per_epoch, loader.used_per_epoch, loader.dropped_per_epoch) == (45, 40, 5)
    seen = [i for _ in range(10) for i in ids_of(next(loader))]
    assert seen == list(range(40)) and loader.epoch == 1 and loader.position == 0
    assert ids_of(next(loader)) == [0, 1, 2, 3]  # samples 40..44 are dropped every epoch


def test_epoch_rollover_keep_remainder_wraps():
    [loader] = make_loaders(10, dp=1, local=4, shuffle=False, drop_remainder=False)
    assert loader.dropped_per_epoch == 0
    assert [ids_of(next(loader)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert loader.epoch == 1 and loader.position == 2
    r0, r1 = make_loaders(10, dp=2, local=3, seed=5, drop_remainder=False)
    stream = np.concatenate([np.random.default_rng([5, e]).permutation(10) for e in range(3)])
    got = [i for _ in range(4) for loader_ in (r0, r1) for i in ids_of(next(loader_))]
    np.testing.assert_array_equal(got, stream[:24])


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_resume_gives_identical_batches(drop_remainder):
    for k in (0, 3, 7, 12):  # 12 crosses two epoch boundaries
        r0, r1 = make_loaders(23, dp=2, local=2, gbs=4, drop_remainder=drop_remainder)
        for _ in range(k):
            next(r0), next(r1)
        state = json.loads(json.dumps(r0.state_dict()))  # JSON-able, as it is saved
        assert state == r1.state_dict()
        expected = [(ids_of(next(r0)), ids_of(next(r1))) for _ in range(8)]
        s0, s1 = make_loaders(23, dp=2, local=2, gbs=4, drop_remainder=drop_remainder)
        s0.load_state_dict(state)
        s1.load_state_dict(state)
        assert s0.dataset.calls == 0  # O(1): nothing was read to get there
        assert s0.epoch == state["epoch"]
        assert [(ids_of(next(s0)), ids_of(next(s1))) for _ in range(8)] == expected


def test_resume_with_another_dp_layout_same_global_batch():
    [single] = make_loaders(30, dp=1, local=4, gbs=4)
    for _ in range(9):
        next(single)
    state = single.state_dict()
    expected = [step_samples([single], 1) for _ in range(5)]
    multi = make_loaders(30, dp=2, local=2, gbs=4)
    for loader in multi:
        loader.load_state_dict(state)
    assert [sorted(step_samples(multi, 1)) for _ in range(5)] == [sorted(s) for s in expected]


def test_state_mismatch_and_argument_errors():
    [loader] = make_loaders(20, dp=1, local=2, seed=1)
    state = loader.state_dict()
    [other] = make_loaders(21, dp=1, local=2, seed=1)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        other.load_state_dict(state)
    [reseeded] = make_loaders(20, dp=1, local=2, seed=2)
    with pytest.raises(ValueError, match="seed"):
        reseeded.load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        loader.load_state_dict({**state, "position": 20})
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make_loaders(5, dp=1, local=2, gbs=8)
    with pytest.raises(ValueError, match="multiple of"):
        make_loaders(50, dp=2, local=2, gbs=6)
    with pytest.raises(ValueError, match="dp_rank"):
        StatefulLoader(IdDataset(9), local_batch_size=1, dp_rank=2, dp_size=2, seed=0, shuffle=False)


# --- build_train_loader --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from meshforge.data.tokenizer import build_tokenizer

    return build_tokenizer("meshforge://assets/tokenizer")


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"Document number {i} says hello."}) + "\n" for i in range(60))
    )
    return path


def _build(cfg, tok, **kw):
    args = {"tokenizer": tok, "local_batch_size": 2, "dp_rank": 0, "dp_size": 1, "seed": 0, **kw}
    return build_train_loader(cfg, LoaderContext(**args))


def test_build_text_loader(tok, tmp_path):
    cfg = TrainDatasetConfig.model_validate(
        {"dataloader": {"type": "TextDataLoader", "data_path": str(_corpus(tmp_path)), "seq_length": 16}}
    )
    lines: list[str] = []
    loader = _build(cfg, tok, log=lines.append, global_batch_size=4)
    assert len(lines) == 1 and lines[0].startswith("text data:")  # no note: nothing set explicitly
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 16) and not loader.shuffle
    assert loader.samples_per_epoch == loader.dataset.num_samples and loader.used_per_epoch % 4 == 0
    first = batch["input_ids"][0].tolist()
    assert first == loader.dataset.stream[:16].tolist()  # no shuffle: sample 0 first


def test_build_notes_explicit_pipeline_settings(tok, tmp_path):
    cfg = TrainDatasetConfig.model_validate(
        {
            "dataloader": {"type": "TextDataLoader", "data_path": str(_corpus(tmp_path)), "seq_length": 8},
            "num_parallel_workers": 8,  # the default value, but set explicitly: still reported
            "prefetch_size": 2,
            "drop_remainder": False,
        }
    )
    lines: list[str] = []
    loader = _build(cfg, tok, log=lines.append)
    assert loader.dropped_per_epoch == 0
    [note] = [line for line in lines if line.startswith("note:")]
    assert "train_dataset.num_parallel_workers" in note and "train_dataset.prefetch_size" in note
    assert "numa_enable" not in note


def test_build_errors_name_keys(tok, tmp_path):
    with pytest.raises(ValueError, match=r"train_dataset\.dataloader\.type: not supported yet"):
        _build(TrainDatasetConfig.model_validate({"dataloader": {"type": "WebDatasetLoader"}}), tok)
    with pytest.raises(ValueError, match=r"train_dataset\.dataloader\.type: no data loader type"):
        _build(TrainDatasetConfig(), tok)
    bad = TrainDatasetConfig.model_validate(
        {"dataloader": {"type": "TextDataLoader", "data_path": "x", "seq_len": 8}}
    )
    with pytest.raises(ValueError, match=r"train_dataset\.dataloader\.seq_len: unknown option"):
        _build(bad, tok)
    missing = TrainDatasetConfig.model_validate(
        {
            "dataloader": {
                "type": "TextDataLoader",
                "data_path": [str(tmp_path / "nope.jsonl")],
                "seq_length": 8,
            }
        }
    )
    with pytest.raises(FileNotFoundError, match=r"data_path\[0\]"):
        _build(missing, tok)


class IdOptions(LoaderOptions):
    n: int

    def sequence(self, data):
        return 1, "train_dataset.dataloader.n"


def test_register_loader(tok, monkeypatch):
    monkeypatch.setitem(LOADERS, "IdLoader", LOADERS["TextDataLoader"])  # removed again at teardown
    seen = {}

    def build_ids(dataset_cfg, ctx):
        seen["n"] = dataset_cfg.dataloader.options_as(IdOptions).n
        return StatefulLoader(
            IdDataset(seen["n"]),
            local_batch_size=ctx.local_batch_size,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp_size,
            seed=ctx.seed,
            shuffle=False,
        )

    register_loader("IdLoader", LoaderKind(IdOptions, IdOptions, build_ids))
    loader = _build(TrainDatasetConfig.model_validate({"dataloader": {"type": "IdLoader", "n": 6}}), tok)
    assert seen == {"n": 6} and ids_of(next(loader)) == [0, 1]
    with pytest.raises(ValidationError, match="n"):
        TrainDatasetConfig.model_validate({"dataloader": {"type": "IdLoader", "n": "six"}})


def test_build_with_real_train_dataset_config(tok, tmp_path):
    config = pytest.importorskip("meshforge.data.config")
    cfg = config.TrainDatasetConfig.model_validate(
        {
            "dataloader": {
                "type": "TextDataLoader",
                "data_path": str(_corpus(tmp_path)),
                "seq_length": 8,
                "shuffle": True,
            }
        }
    )
    loader = _build(cfg, tok, dp_size=2, dp_rank=1, global_batch_size=4)
    assert loader.shuffle and next(loader)["labels"].shape == (2, 8)
