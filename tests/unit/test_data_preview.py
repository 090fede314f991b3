"""`meshforge data preview`: rows in the trainer's unshuffled order, batch-contract keys, masked spans in `text`."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np

from meshforge.cli.main import main
from meshforge.config import load_config
from meshforge.data.preview import (
    MASK_CLOSE,
    MASK_OPEN,
    build_preview_loader,
    masked_text,
    preview_rows,
    print_rows,
)
from meshforge.utils.resources import resolve_path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
MEGATRON = REPO / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"
ALPACA = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
CHATML = REPO / "configs" / "qwen3" / "sft_chatml_tiny.yaml"


def _spans(text: str) -> list[tuple[bool, str]]:
    """Split a preview text into (masked, piece) runs; fails on unbalanced markers."""
    out = []
    rest = text
    while rest:
        start = rest.find(MASK_OPEN)
        if start < 0:
            assert MASK_CLOSE not in rest
            out.append((False, rest))
            break
        if start:
            assert MASK_CLOSE not in rest[:start]
            out.append((False, rest[:start]))
        end = rest.index(MASK_CLOSE, start)
        out.append((True, rest[start + len(MASK_OPEN) : end]))
        rest = rest[end + len(MASK_CLOSE) :]
    return out


def _expected_spans(tok, ids: list[int], labels: list[int]) -> list[tuple[bool, str]]:
    """Runs of tokens that are / are not loss targets, computed here from the shifted labels."""
    flags = [True] + [label == -100 for label in labels[:-1]]  # token j is the target of position j-1
    runs: list[tuple[bool, list[int]]] = []
    for flag, token in zip(flags, ids, strict=True):
        if runs and runs[-1][0] == flag:
            runs[-1][1].append(token)
        else:
            runs.append((flag, [token]))
    kwargs = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    return [(flag, tok.decode(part, **kwargs)) for flag, part in runs]


def _check_rows(rows, tok, keys):
    for row in rows:
        assert set(row) == {"index", "text", *keys}
        lengths = {len(row[key]) for key in keys}
        assert len(lengths) == 1
        assert _spans(row["text"]) == _expected_spans(tok, row["input_ids"], row["labels"])


def _contract(loader_batch, k):
    return {key: value[k].tolist() for key, value in loader_batch.items()}


def test_demo_text_rows_follow_the_unshuffled_loader(tmp_path):
    from meshforge.data.build import LoaderContext, build_train_loader
    from tests.conftest import write_corpus

    data = [f"train_dataset.dataloader.data_path={write_corpus(tmp_path / 'corpus.jsonl')}"]
    cfg = load_config(DEMO, data)
    assert cfg.train_dataset.dataloader.shuffle is True  # the preview turns it off
    tok, loader = build_preview_loader(cfg)
    rows = preview_rows(cfg, 5, loader=(tok, loader))
    assert [row["index"] for row in rows] == list(range(5))
    _check_rows(rows, tok, ("input_ids", "labels"))
    assert all(len(row["input_ids"]) == 128 for row in rows)
    # the first micro-batch a trainer with shuffle off reads holds exactly these rows, in this order
    off = load_config(DEMO, [*data, "train_dataset.dataloader.shuffle=false"])
    trainer_loader = build_train_loader(
        off.train_dataset,
        LoaderContext(
            tokenizer=tok,
            local_batch_size=16,
            dp_rank=0,
            dp_size=1,
            seed=42,
            global_batch_size=16,
        ),
    )
    batch = next(trainer_loader)
    for k, row in enumerate(rows):
        assert _contract(batch, k) == {key: row[key] for key in ("input_ids", "labels")}
    # text data: only the first token of a row is not a target
    assert rows[0]["text"].startswith(MASK_OPEN) and rows[0]["text"].count(MASK_OPEN) == 1


def test_megatron_rows_with_document_masks(tmp_path):
    overrides = [
        f"train_dataset.dataloader.config.path_to_cache={tmp_path / 'cache'}",
        "train_dataset.dataloader.config.reset_attention_mask=true",
        "train_dataset.dataloader.config.reset_position_ids=true",
        "train_dataset.dataloader.config.eod_mask_loss=true",
        "training.steps=4",
    ]
    cfg = load_config(MEGATRON, overrides)
    tok, loader = build_preview_loader(cfg)
    rows = preview_rows(cfg, 6, loader=(tok, loader))
    _check_rows(rows, tok, ("input_ids", "labels", "position_ids", "segment_ids"))
    # the Megatron dataset is sized as the run sizes it (steps x global batch) and read in its own order
    assert len(loader.dataset) >= 4 * 16
    batch = loader.dataset.get_batch(np.arange(6))
    for k, row in enumerate(rows):
        assert row == {"index": k, **_contract(batch, k), "text": row["text"]}
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    docs = 0
    for row in rows:
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        assert (labels[ids == eod] == -100).all()  # eod_mask_loss
        docs += int((ids == eod).sum())
        # the token after an EOD is not a target: it shows inside a masked span
        for (masked, piece), (next_masked, _) in zip(_spans(row["text"]), _spans(row["text"])[1:]):
            if not masked and piece.endswith("<|endoftext|>"):
                assert next_masked
    assert docs > 0


def test_sft_packed_rows_keep_padding_and_mask_prompts(tmp_path):
    cfg = load_config(ALPACA)
    tok, loader = build_preview_loader(cfg)
    rows = preview_rows(cfg, 8, loader=(tok, loader))
    _check_rows(rows, tok, ("input_ids", "labels", "position_ids"))
    assert all(len(row["input_ids"]) == 256 for row in rows)  # packed rows: cutoff_len, padding kept
    padded = ends = 0
    for row in rows:
        ids, labels, pos = (np.asarray(row[k]) for k in ("input_ids", "labels", "position_ids"))
        tail = (ids == tok.pad_token_id) & (pos == 0)
        if tail[-1]:
            padded += 1
            start = len(tail) - int(np.argmin(tail[::-1])) if not tail.all() else 0
            assert (labels[max(start - 1, 0) :] == -100).all()
        for masked, piece in _spans(row["text"]):
            if masked and "<|im_start|>" in piece:
                assert piece.startswith("<|im_start|>user") and piece.endswith("<|im_start|>assistant\n")
            if not masked:  # what is trained: the answers (qwen3: an empty think block first)
                assert piece.startswith("<think>\n\n</think>\n\n")
                ends += piece.endswith("<|im_end|>\n")  # unless truncated by cutoff_len
    assert padded > 0 and ends > 0
    # the trainer order with shuffle off is the dataset's row order; unshifted labels are LLaMA-Factory's
    for k, row in enumerate(rows):
        ref = loader.dataset.row(k)
        assert row["input_ids"] == ref["input_ids"].tolist()
        assert row["labels"][:-1] == ref["labels"][1:].tolist()


def test_sft_unpacked_rows_have_their_own_length(tmp_path):
    cfg = load_config(ALPACA, ["train_dataset.packing=false"])
    tok, loader = build_preview_loader(cfg)
    rows = preview_rows(cfg, 4, loader=(tok, loader))
    _check_rows(rows, tok, ("input_ids", "labels"))
    lengths = [len(row["input_ids"]) for row in rows]
    assert lengths == [len(loader.dataset.row(k)["input_ids"]) for k in range(4)]
    assert min(lengths) < 256  # no batch padding


def test_sft_neat_packing_segments(tmp_path):
    cfg = load_config(CHATML, ["train_dataset.max_samples=200"])
    tok, loader = build_preview_loader(cfg)
    rows = preview_rows(cfg, 3, loader=(tok, loader))
    _check_rows(rows, tok, ("input_ids", "labels", "position_ids", "segment_ids"))
    for row in rows:
        seg, pos = np.asarray(row["segment_ids"]), np.asarray(row["position_ids"])
        assert len(seg) == 256
        starts = np.flatnonzero(np.diff(seg)) + 1
        real = starts[seg[starts] > 0]
        assert (pos[real] == 0).all()  # positions restart per example
        assert (seg[seg == 0].size == 0) or (np.asarray(row["labels"])[seg == 0] == -100).all()


def test_no_process_group_and_tokenizer_only_folder(tmp_path, monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("data preview must not create a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    model_dir = tmp_path / "tokenizer_only"
    shutil.copytree(resolve_path("meshforge://assets/tokenizer"), model_dir)
    assert not (model_dir / "config.json").exists()
    text = MEGATRON.read_text(encoding="utf-8").replace(
        "tokenizer_name_or_path: meshforge://assets/tokenizer", f"model_name_or_path: {model_dir}"
    )
    config = tmp_path / "pretrain.yaml"
    config.write_text(text, encoding="utf-8")
    cfg = load_config(config, [f"train_dataset.dataloader.config.path_to_cache={tmp_path / 'cache'}"])
    assert cfg.model.tokenizer_name_or_path is None
    rows = preview_rows(cfg, 2)
    assert len(rows) == 2 and len(rows[0]["input_ids"]) == 128
    assert not dist.is_initialized()


def test_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "rows" / "preview.jsonl"
    argv = ["data", "preview", "--config", str(ALPACA), "--num-samples", "3", "--output", str(out)]
    assert main([*argv, "--train_dataset.cutoff_len=128"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3 and all(len(row["input_ids"]) == 128 for row in rows)
    assert "wrote 3 row(s)" in capsys.readouterr().err
    # without --output and not a terminal: JSON lines on stdout, logs on stderr
    assert main(["data", "preview", "-c", str(ALPACA), "-n", "2"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["index"] for line in captured.out.splitlines()] == [0, 1]


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["data", "preview", "-c", str(ALPACA), "-n", "0"]) == 2
    assert "--num-samples" in capsys.readouterr().err
    assert main(["data", "preview", "-c", str(ALPACA), "--train_dataset.dataset=nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_more_rows_than_an_epoch_and_pretty_print(tmp_path):
    lines: list[str] = []
    cfg = load_config(ALPACA)
    rows = preview_rows(cfg, 10_000, log=lines.append)
    # 107 packed rows, global batch 8: the trainer uses 104 per epoch
    assert len(rows) == 104 and any("104 row(s) per epoch" in line for line in lines)
    buf = io.StringIO()
    print_rows(rows[:2], buf)
    shown = buf.getvalue()
    assert "row 0: sample 0, 256 tokens" in shown and "row 1: sample 1" in shown
    assert MASK_OPEN in shown and "<|im_start|>user" in shown


def test_masked_text_marks_runs():
    class Tok:
        def decode(self, ids, **kwargs):
            return "".join(f"<{i}>" for i in ids)

    ids = [1, 2, 3, 4, 5, 6]
    labels = [-100, -100, 4, 5, -100, -100]  # targets: tokens 3 and 4 (positions 2, 3 -> 4, 5)
    assert masked_text(Tok(), ids, labels) == "[MASKED]<1><2><3>[/MASKED]<4><5>[MASKED]<6>[/MASKED]"
    assert masked_text(Tok(), [], []) == ""


def test_stream_loader_rows_come_from_its_batches():
    import torch

    class Tok:
        def decode(self, ids, **kwargs):
            return "".join(f"<{i}>" for i in ids)

    class Stream:  # no random access: only batches, in order
        def __iter__(self):
            for start in range(0, 100, 2):
                ids = torch.arange(start, start + 2).reshape(2, 1).repeat(1, 3)
                yield {"input_ids": ids, "labels": torch.full((2, 3), -100)}

    rows = preview_rows(None, 3, loader=(Tok(), Stream()))
    assert [row["index"] for row in rows] == [0, 1, 2]
    assert [row["input_ids"] for row in rows] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert rows[2]["text"] == "[MASKED]<2><2><2>[/MASKED]"


def test_mindspeed_format_config(tmp_path, monkeypatch):
    shutil.copytree(resolve_path("meshforge://assets/tokenizer"), tmp_path / "tok")
    config = tmp_path / "ms.yaml"
    config.write_text(
        "model:\n  model_name_or_path: ./tok\n"
        f"data:\n  dataset: alpaca_demo\n  dataset_dir: {resolve_path('meshforge://assets/sft')}\n"
        "  template: qwen3\n  cutoff_len: 128\n  packing: true\n"
        "training:\n  max_steps: 2\n  per_device_train_batch_size: 2\n  output_dir: ./out\n",
        encoding="utf-8",
    )
    out = tmp_path / "rows.jsonl"
    monkeypatch.chdir(tmp_path)  # relative paths of the config resolve against the working directory
    assert main(["data", "preview", "-c", str(config), "-n", "2", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [len(row["input_ids"]) for row in rows] == [128, 128]
    assert "<|im_start|>assistant\n[/MASKED]<think>" in rows[0]["text"]


def test_refuses_the_data_features_train_refuses(monkeypatch, capsys):
    from meshforge.config import unsupported

    entries = [
        unsupported.Unsupported("train_dataset.packing", lambda c: True, "pretend: not built"),
        unsupported.Unsupported("parallelism.pipeline_parallel", lambda c: True, "not data: ignored here"),
    ]
    monkeypatch.setattr(unsupported, "unsupported_entries", lambda cfg: [e for e in entries if e.is_set(cfg)])
    assert main(["data", "preview", "-c", str(ALPACA), "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "not supported yet: train_dataset.packing" in err and "pipeline_parallel" not in err
