"""SFTDataLoader end to end: files -> rows -> batches, mixing, tokenized_path, resume, neat packing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.config import ConfigError, config_from_dict  # noqa: E402
from meshforge.data.build import LoaderContext, build_train_loader  # noqa: E402
from meshforge.data.sft.loader import build_sft_dataset  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402
from tests._compare import assert_close

X = -100


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def write_alpaca(path, n, tag="a"):
    rows = [
        {"instruction": f"{tag} question {i}", "input": "", "output": f"answer {i} " * (1 + i % 4)}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def sft_cfg(tmp_path, **fields):
    data = {
        "train_dataset": {
            "dataloader": {"type": "SFTDataLoader"},
            "template": "chatml",
            "cutoff_len": 64,
            **fields,
        }
    }
    return config_from_dict(data).train_dataset


def rows(ds):
    return [ds.row(i) for i in range(len(ds))]


def test_batches_pad_to_cutoff_and_shift_labels(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 10)
    cfg = sft_cfg(tmp_path, dataset={"file_name": str(tmp_path / "a.jsonl")})
    ds = build_sft_dataset(cfg, tok, seed=0)
    assert len(ds) == 10
    batch = ds.get_batch(np.array([3]))
    row = ds.row(3)
    n = len(row["input_ids"])
    assert batch["input_ids"].shape == (1, 64) and set(batch) == {"input_ids", "labels"}
    assert (batch["input_ids"][0, :n] == row["input_ids"]).all() and (
        batch["input_ids"][0, n:] == tok.pad_token_id
    ).all()
    # labels[i] is the target of token i: the stored (unshifted) labels moved left by one.
    assert (batch["labels"][0, : n - 1] == row["labels"][1:]).all() and (
        batch["labels"][0, n - 1 :] == X
    ).all()
    assert tok.decode(row["input_ids"]).startswith("<|im_start|>user\na question 3<|im_end|>")
    no_ignore = build_sft_dataset(
        sft_cfg(tmp_path, dataset={"file_name": str(tmp_path / "a.jsonl")}, ignore_pad_token_for_loss=False),
        tok,
        seed=0,
    )
    labels = no_ignore.get_batch(np.array([3]))["labels"][0]
    assert (labels[n - 1 : -1] == tok.pad_token_id).all() and labels[-1] == X  # nothing follows the row


def test_broken_records_counted_and_empty_dataset_named(tmp_path, tok):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    bad = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]}
    empty = {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "a"}]}
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, bad, bad, empty]) + "\n")
    lines: list[str] = []
    ds = build_sft_dataset(
        sft_cfg(tmp_path, dataset={"file_name": str(path), "formatting": "sharegpt"}),
        tok,
        seed=0,
        log=lines.append,
    )
    assert len(ds) == 1
    assert any(
        "dropped 3 broken record(s): roles not alternating x2, empty turn x1" in line for line in lines
    )
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"has no usable example"):
        build_sft_dataset(
            sft_cfg(tmp_path, dataset={"file_name": str(path), "formatting": "sharegpt"}), tok, seed=0
        )


def test_missing_column_is_named(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 3)
    cfg = sft_cfg(
        tmp_path,
        dataset={
            "file_name": str(tmp_path / "a.jsonl"),
            "columns": {"prompt": "instruction", "response": "reply"},
        },
    )
    with pytest.raises(ValueError, match=r"missing column\(s\) response='reply'"):
        build_sft_dataset(cfg, tok, seed=0)


def test_mixing_and_interleave_probs_length(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 6, "a")
    write_alpaca(tmp_path / "b.jsonl", 2, "b")
    info = {"a": {"file_name": "a.jsonl"}, "b": {"file_name": "b.jsonl"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    common = {"dataset": "a,b", "dataset_dir": str(tmp_path)}
    assert len(build_sft_dataset(sft_cfg(tmp_path, **common), tok, seed=0)) == 8
    under = build_sft_dataset(sft_cfg(tmp_path, **common, mix_strategy="interleave_under"), tok, seed=0)
    # round-robin without probabilities, stopping when b (2 rows) runs out: a0 b0 a1 b1 a2
    texts = [tok.decode(r["input_ids"]).split("\n")[1] for r in rows(under)]
    assert texts[:4] == [
        "a question 0<|im_end|>",
        "b question 0<|im_end|>",
        "a question 1<|im_end|>",
        "b question 1<|im_end|>",
    ]
    over = build_sft_dataset(sft_cfg(tmp_path, **common, mix_strategy="interleave_over"), tok, seed=0)
    assert len(over) == 12  # all exhausted: b is repeated until a's 6 rows are used
    with pytest.raises(
        ConfigError, match=r"interleave_probs.*has 3 values but train_dataset.dataset names 2"
    ):
        sft_cfg(tmp_path, **common, mix_strategy="interleave_under", interleave_probs="0.2,0.3,0.5")
    capped = build_sft_dataset(sft_cfg(tmp_path, **common, max_samples=1), tok, seed=0)
    assert len(capped) == 2  # max_samples applies to each dataset


def test_tokenized_path_round_trip(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 12)
    tok_dir = tmp_path / "tokenized"
    first_log: list[str] = []
    cfg = sft_cfg(
        tmp_path, dataset={"file_name": str(tmp_path / "a.jsonl")}, packing=True, tokenized_path=str(tok_dir)
    )
    first = build_sft_dataset(cfg, tok, seed=0, log=first_log.append)
    assert any("saved" in line for line in first_log) and tok_dir.is_dir()
    # Second run: the data options no longer matter (the file is gone), the saved rows are used.
    (tmp_path / "a.jsonl").unlink()
    second_log: list[str] = []
    cfg2 = sft_cfg(
        tmp_path,
        dataset={"file_name": str(tmp_path / "gone.jsonl")},
        packing=True,
        tokenized_path=str(tok_dir),
    )
    second = build_sft_dataset(cfg2, tok, seed=0, log=second_log.append)
    assert any("all other data options" in line and "ignored" in line for line in second_log)
    idx = np.arange(len(first))
    for key, value in first.get_batch(idx).items():
        assert (second.get_batch(idx)[key] == value).all(), key


def test_loader_resume_continues_with_next_batch(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 40)
    cfg = config_from_dict(
        {
            "train_dataset": {
                "dataloader": {"type": "SFTDataLoader", "shuffle": True},
                "dataset": {"file_name": str(tmp_path / "a.jsonl")},
                "template": "chatml",
                "cutoff_len": 64,
                "packing": True,
            }
        }
    ).train_dataset

    def loader():
        return build_train_loader(
            cfg,
            LoaderContext(
                tokenizer=tok,
                local_batch_size=2,
                dp_rank=0,
                dp_size=1,
                seed=3,
                global_batch_size=2,
            ),
        )

    full = loader()
    batches = [next(full) for _ in range(6)]
    first = loader()
    for _ in range(3):
        next(first)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    for expected in batches[3:]:
        got = next(resumed)
        assert set(got) == {"input_ids", "labels", "position_ids"}
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_neat_packed_row_gives_each_example_its_own_logits(tmp_path, tok):
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import Qwen3ForCausalLM

    write_alpaca(tmp_path / "a.jsonl", 6)
    cfg = sft_cfg(
        tmp_path, dataset={"file_name": str(tmp_path / "a.jsonl")}, neat_packing=True, cutoff_len=96
    )
    ds = build_sft_dataset(cfg, tok, seed=0)
    batch = {k: torch.from_numpy(v) for k, v in ds.get_batch(np.array([0])).items()}
    segments = batch["segment_ids"][0]
    assert int(segments.max()) >= 2  # the row really holds several examples
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Args(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=128,
        )
    ).eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])[0]
        for seg in range(1, int(segments.max()) + 1):
            where = (segments == seg).nonzero().flatten()
            alone = model(batch["input_ids"][:, where])[0]
            assert_close(packed[where], alone, what="packed vs alone")


def test_reset_attention_mask_separates_packed_examples_as_neat_packing(tmp_path, tok):
    """MindSpeed's reset_attention_mask + append_eod on packed SFT rows: one segment per example."""
    write_alpaca(tmp_path / "a.jsonl", 6)
    source = {"file_name": str(tmp_path / "a.jsonl")}

    def packed(**fields):
        cfg = sft_cfg(tmp_path, dataset=source, packing=True, cutoff_len=96, **fields)
        return rows(build_sft_dataset(cfg, tok, seed=0))

    reset = packed(reset_attention_mask=True, append_eod=True)
    neat = packed(neat_packing=True)
    plain = packed()
    assert len(reset) == len(neat)
    for got, want in zip(reset, neat, strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    # Without the switch the packed examples share one segment and attend to each other.
    assert max(int(r["segment_ids"].max()) for r in reset) >= 2
    assert all("segment_ids" not in r or int(r["segment_ids"].max()) <= 1 for r in plain)


def test_two_ranks_resume_and_match_one_rank(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 40)
    cfg = sft_cfg(tmp_path, dataset={"file_name": str(tmp_path / "a.jsonl")})
    cfg = cfg.model_copy(update={"dataloader": cfg.dataloader.model_copy(update={"shuffle": True})})

    def loader(rank, size, local):
        return build_train_loader(
            cfg,
            LoaderContext(
                tokenizer=tok,
                local_batch_size=local,
                dp_rank=rank,
                dp_size=size,
                seed=5,
                global_batch_size=4,
            ),
        )

    one = loader(0, 1, 4)
    steps = [next(one) for _ in range(4)]
    ranks = [loader(r, 2, 2) for r in range(2)]
    for _ in range(2):
        for r in ranks:
            next(r)
    resumed = [loader(r, 2, 2) for r in range(2)]
    for r, old in zip(resumed, ranks, strict=True):
        r.load_state_dict(old.state_dict())
    for expected in steps[2:]:
        got = [next(r) for r in resumed]
        # rank 0 takes the first half of the step's samples, rank 1 the second
        assert torch.equal(torch.cat([g["input_ids"] for g in got]), expected["input_ids"])
        assert torch.equal(torch.cat([g["labels"] for g in got]), expected["labels"])


def test_num_samples_oversamples(tmp_path, tok):
    write_alpaca(tmp_path / "a.jsonl", 10)
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"a": {"file_name": "a.jsonl", "num_samples": 15}})
    )
    ds = build_sft_dataset(sft_cfg(tmp_path, dataset="a", dataset_dir=str(tmp_path)), tok, seed=0)
    texts = [tok.decode(r["input_ids"]) for r in rows(ds)]
    assert len(texts) == 15 and len(set(texts)) == 10  # all 10 once (a permutation), then 5 drawn again
