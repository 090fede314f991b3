"""BlendedMegatronDatasetDataLoader through build_train_loader: order, sizing, resume, segments, errors."""

from __future__ import annotations

import numpy as np
import pytest

from meshforge.data.build import LoaderContext, build_train_loader
from meshforge.data.config import TrainDatasetConfig
from meshforge.data.megatron.gpt_dataset import GPTDataset
from meshforge.data.megatron.indexed import IndexedDatasetWriter
from meshforge.data.specs import check_dataloader_options
from tests._compare import assert_close

EOD = 0


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mg")
    rng = np.random.default_rng(0)
    path = folder / "corpus_text_document"
    with IndexedDatasetWriter(path, np.uint16) as w:
        for _ in range(150):
            w.add_document(np.r_[rng.integers(1, 1000, int(rng.integers(2, 25))), EOD])
    return str(path)


def _cfg(prefix, tmp_path, *, shuffle=False, columns=None, sizes=None, **config):
    loader = {
        "type": "BlendedMegatronDatasetDataLoader",
        "shuffle": shuffle,
        "config": {
            "seq_length": 16,
            "split": "1,0,0",
            "eod": EOD,
            "data_path": [prefix],
            "path_to_cache": str(tmp_path / "cache"),
            **config,
        },
    }
    if columns is not None:
        loader["column_names"] = columns
    if sizes is not None:
        loader["sizes"] = sizes
    return TrainDatasetConfig.model_validate({"dataloader": loader})


def _loaders(cfg, *, dp, local, gbs, total_steps=None, seed=11, tokenizer=None, log=None):
    return [
        build_train_loader(
            cfg,
            LoaderContext(
                tokenizer=tokenizer,
                local_batch_size=local,
                dp_rank=r,
                dp_size=dp,
                seed=seed,
                global_batch_size=gbs,
                total_steps=total_steps,
                log=log,
            ),
        )
        for r in range(dp)
    ]


def test_batches_are_megatron_order_and_sized_by_steps(prefix, tmp_path):
    lines = []
    [loader] = _loaders(
        _cfg(prefix, tmp_path, columns=["input_ids", "labels", "loss_mask", "position_ids"]),
        dp=1,
        local=4,
        gbs=8,
        total_steps=30,
        log=lines.append,
    )
    ds = loader.dataset
    assert isinstance(ds, GPTDataset) and ds.requested_samples == 240 and len(ds) >= 240
    assert not any(line.startswith("note:") for line in lines)
    assert any("Megatron data:" in line and "eod id 0" in line for line in lines)
    for step in range(3):
        batch = next(loader)
        expected = ds.get_batch(np.arange(step * 4, step * 4 + 4))
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        for key, value in expected.items():
            assert np.array_equal(batch[key].numpy(), value)
    [sized] = _loaders(_cfg(prefix, tmp_path, sizes=[64, 0, 0]), dp=1, local=4, gbs=8, total_steps=30)
    assert sized.dataset.requested_samples == 64


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_continues_with_the_next_unseen_batch(prefix, tmp_path, dp):
    cfg = _cfg(prefix, tmp_path, shuffle=True)
    full = _loaders(cfg, dp=dp, local=2, gbs=4, total_steps=10)
    steps = len(full[0].dataset) // 4 + 6  # crosses an epoch end of the loader
    run = [[next(ld)["input_ids"].clone() for ld in full] for _ in range(steps)]
    part = _loaders(cfg, dp=dp, local=2, gbs=4, total_steps=10)
    for _ in range(steps - 10):
        for ld in part:
            next(ld)
    state = part[0].state_dict()
    resumed = _loaders(cfg, dp=dp, local=2, gbs=4, total_steps=10)
    for ld in resumed:
        ld.load_state_dict(state)
    for step in range(steps - 10, steps):
        for r, ld in enumerate(resumed):
            assert np.array_equal(next(ld)["input_ids"].numpy(), run[step][r].numpy())
    # dp ranks read disjoint chunks of the same global order
    if dp == 2:
        assert not np.array_equal(run[0][0].numpy(), run[0][1].numpy())


def test_documents_separated_and_positions_reset(prefix, tmp_path):
    cfg = _cfg(prefix, tmp_path, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    [loader] = _loaders(cfg, dp=1, local=3, gbs=3, total_steps=2)
    batch = {k: v.numpy() for k, v in next(loader).items()}
    assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
    for ids, labels, pos, seg in zip(
        batch["input_ids"], batch["labels"], batch["position_ids"], batch["segment_ids"], strict=True
    ):
        ends = np.flatnonzero(ids == EOD)
        starts = np.r_[0, ends + 1]
        starts = starts[starts < len(ids)]
        assert (pos[starts] == 0).all() and (np.diff(pos)[np.diff(seg) == 0] == 1).all()
        assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1} and seg[-1] == 1 + len(ends[ends < len(ids) - 1])
        assert (labels[ids == EOD] == -100).all()


def test_eod_defaults_to_the_tokenizer_rule(prefix, tmp_path):
    from meshforge.data.tokenizer import build_tokenizer

    tok = build_tokenizer("meshforge://assets/tokenizer")
    cfg = TrainDatasetConfig.model_validate(
        {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "config": {"seq_length": 16, "data_path": [prefix], "path_to_cache": str(tmp_path / "c")},
            }
        }
    )
    [loader] = _loaders(cfg, dp=1, local=2, gbs=2, total_steps=3, tokenizer=tok)
    assert loader.dataset.config.eod == tok.convert_tokens_to_ids("<|endoftext|>")


def test_option_and_data_errors_name_their_keys(prefix, tmp_path):
    issues = dict(
        check_dataloader_options(
            "BlendedMegatronDatasetDataLoader",
            {"sizes": [1, 2, 3, 4], "config": {"seq_length": 1, "data_path": [], "reset_attn_mask": True}},
        )
    )
    assert "sizes" in issues and "config.seq_length" in issues and "config.data_path" in issues
    assert "did you mean 'reset_attention_mask'" in issues["config.reset_attn_mask"]
    with pytest.raises(ValueError, match=r"column_names\[1\]: 'segment' is not a Megatron dataset column"):
        _loaders(
            _cfg(prefix, tmp_path, columns=["input_ids", "segment"]), dp=1, local=2, gbs=2, total_steps=2
        )
    with pytest.raises(FileNotFoundError, match="nope_text_document.idx"):
        _loaders(_cfg(str(tmp_path / "nope_text_document"), tmp_path), dp=1, local=2, gbs=2, total_steps=2)
    weighted = _cfg(prefix, tmp_path, data_path=["0.5", prefix, "0.5", prefix])
    with pytest.raises(
        ValueError, match=r"config\.data_path: blend weights need a requested number of samples"
    ):
        _loaders(weighted, dp=1, local=2, gbs=2)
    [blend] = _loaders(weighted, dp=1, local=2, gbs=2, total_steps=5)
    assert len(blend.dataset) == 10


def test_packed_row_logits_equal_each_document_alone(prefix, tmp_path):
    # The model honours segment_ids and position_ids: a Megatron row with separated documents gives
    # each document the logits it gets when run by itself (float32, SDPA block-diagonal mask on CPU).
    import torch

    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3

    args = Qwen3Args(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    model = build_qwen3(args, device="cpu").eval()
    cfg = _cfg(prefix, tmp_path, seq_length=48, reset_attention_mask=True, reset_position_ids=True)
    [loader] = _loaders(cfg, dp=1, local=2, gbs=2, total_steps=2)
    batch = next(loader)
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        for row in range(2):
            seg = batch["segment_ids"][row]
            assert int(seg.max()) >= 3  # several documents in the row
            for s in seg.unique().tolist():
                cols = (seg == s).nonzero().flatten()
                alone = model(batch["input_ids"][row, cols][None])[0]
                assert_close(packed[row, cols], alone, what=(row, cols))


def test_valid_split_built_only_when_asked(prefix, tmp_path):
    from meshforge.data.megatron.loader import build_megatron_dataset
    from meshforge.data.megatron.specs import MegatronDataLoaderOptions

    cfg = _cfg(prefix, tmp_path, split="9,1,0")
    _loaders(cfg, dp=1, local=2, gbs=2, total_steps=3)
    names = [p.name for p in (tmp_path / "cache").iterdir()]
    assert names and all("-GPTDataset-train-" in n for n in names)
    options = cfg.dataloader.options_as(MegatronDataLoaderOptions)
    train, valid = build_megatron_dataset(options, tokenizer=None, seed=1, num_samples=10, with_valid=True)
    assert len(train) >= 10 and len(valid) > 0 and valid.split == "valid"
    assert set(valid.documents.tolist()).isdisjoint(train.documents.tolist())
    with pytest.raises(ValueError, match=r"\(valid split\): 0 documents"):
        tiny = _cfg(prefix, tmp_path, split="1000,1,0").dataloader.options_as(MegatronDataLoaderOptions)
        build_megatron_dataset(tiny, tokenizer=None, seed=1, num_samples=10, with_valid=True)


def test_missing_eod_is_named(prefix, tmp_path):
    class NoEod:
        eos_token_id = None

        def get_vocab(self):
            return {"a": 1}

    cfg = TrainDatasetConfig.model_validate(
        {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "config": {"seq_length": 16, "data_path": [prefix], "path_to_cache": str(tmp_path / "c")},
            }
        }
    )
    with pytest.raises(ValueError, match=r"config\.eod: not set, and the tokenizer has neither"):
        _loaders(cfg, dp=1, local=2, gbs=2, total_steps=3, tokenizer=NoEod())
