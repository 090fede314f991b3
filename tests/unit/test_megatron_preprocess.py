"""`meshforge preprocess` end to end with the bundled tokenizer: outputs, EOD rule, bad lines, workers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshforge.cli.preprocess import main
from meshforge.data.megatron.indexed import IndexedDataset
from meshforge.data.tokenizer import build_tokenizer

TOKENIZER = "meshforge://assets/tokenizer"
TEXTS = ["Return the sum of a and b.", "", "A second document\nwith two lines.", "x" * 50]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _run(*argv) -> int:
    return main(["preprocess", *map(str, argv)])


def test_jsonl_to_bin_idx_with_eod(tmp_path, tok, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": t, "meta": i} for i, t in enumerate(TEXTS)])
    rc = _run(
        "--input", src, "--output-prefix", tmp_path / "out" / "c", "--tokenizer", TOKENIZER, "--append-eod"
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    assert f"EOD: appending id {eod} ('<|endoftext|>')" in err
    ds = IndexedDataset(tmp_path / "out" / "c_text_document")
    assert ds.dtype == np.uint16  # vocabulary 8,192
    # An empty text is a document without sequences, as Megatron writes it.
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3]
    expected = [tok(t)["input_ids"] + [eod] for t in TEXTS if t]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert "done: 1 file(s), 4 documents" in out and f"{sum(map(len, expected)):,} tokens (text)" in out
    assert "1 document value(s) gave no tokens" in out and "skipped records: 0 (none)" in out


def test_bad_line_stops_with_file_and_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n\n{"text": "broken\n{"body": "no text key"}\n', encoding="utf-8")
    rc = _run("--input", src, "--output-prefix", tmp_path / "o", "--tokenizer", TOKENIZER)
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {src}:3: not valid JSON" in err and "--skip-invalid" in err


def test_skip_invalid_counts_by_reason(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [
        '{"text": "ok"}',
        '{"text": "bro',
        '{"body": 1}',
        '{"text": 5}',
        "[1]",
        '{"text": "fine"}',
        "{bad",
    ]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tmp_path / "o"
    rc = _run("--input", src, "--output-prefix", prefix, "--tokenizer-model", TOKENIZER, "--skip-invalid")
    out = capsys.readouterr().out
    assert rc == 0
    assert "2 documents" in out and "skipped records: 5" in out
    assert "2 x not valid JSON" in out and "1 x missing key 'text'" in out
    assert "1 x 'text' is not a string or a list of strings (got int)" in out
    assert "1 x record is not a JSON object (got list)" in out
    assert len(IndexedDataset(f"{prefix}_text_document")) == 2


def test_txt_json_keys_and_tokenizer_type(tmp_path, tok, capsys):
    txt = tmp_path / "in.txt"
    txt.write_text("first line\n\nsecond line\n", encoding="utf-8")
    assert _run("--input", txt, "--output-prefix", tmp_path / "t", "--tokenizer-name-or-path", TOKENIZER) == 0
    ds = IndexedDataset(tmp_path / "t_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tok("first line")["input_ids"],
        tok("second line")["input_ids"],
    ]
    arr = tmp_path / "in.json"
    arr.write_text(json.dumps([{"q": "a b", "a": "c"}, {"q": "d", "a": "e f"}]), encoding="utf-8")
    rc = _run(
        "--input", arr, "--output-prefix", tmp_path / "j", "--tokenizer", TOKENIZER, "--json-keys", "q", "a"
    )
    assert rc == 0
    assert (
        len(IndexedDataset(tmp_path / "j_q_document")) == 2
        and len(IndexedDataset(tmp_path / "j_a_document")) == 2
    )
    capsys.readouterr()
    rc = _run(
        "--input",
        arr,
        "--output-prefix",
        tmp_path / "x",
        "--tokenizer",
        TOKENIZER,
        "--tokenizer-type",
        "GPT2BPETokenizer",
    )
    assert rc == 2 and "--tokenizer-type 'GPT2BPETokenizer' is not supported" in capsys.readouterr().err
    rc = _run(
        "--input",
        arr,
        "--output-prefix",
        tmp_path / "x",
        "--tokenizer",
        TOKENIZER,
        "--append-eod",
        "--eod-token",
        "<nope>",
    )
    assert rc == 2 and "--eod-token: '<nope>' is not a token" in capsys.readouterr().err


@pytest.mark.procs  # worker processes
def test_workers_give_the_same_files(tmp_path, capsys):
    records = [{"text": f"document {i} " + "word " * (i % 17)} for i in range(1500)]
    src = _jsonl(tmp_path / "in.jsonl", records)
    for workers in (1, 2):
        rc = _run(
            "--input",
            src,
            "--output-prefix",
            tmp_path / f"w{workers}",
            "--tokenizer",
            TOKENIZER,
            "--append-eod",
            "--workers",
            workers,
        )
        assert rc == 0
    for ext in ("bin", "idx"):
        one = (tmp_path / f"w1_text_document.{ext}").read_bytes()
        assert one == (tmp_path / f"w2_text_document.{ext}").read_bytes()


def test_progress_lines_and_megatron_flags(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(2500)])
    base = ["--input", src, "--output-prefix", tmp_path / "p", "--tokenizer", TOKENIZER]
    # A Megatron script's flags port unchanged (--dataset-impl mmap, --log-interval in documents).
    assert (
        _run(
            *base, "--dataset-impl", "mmap", "--log-interval", "1000", "--tokenizer-type", "PretrainedFromHF"
        )
        == 0
    )
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed ")]
    # Reports come per chunk of 2048 records, once a multiple of --log-interval is passed.
    assert len(progress) == 1 and progress[0].startswith("processed 2,048 documents (")
    assert "docs/s" in progress[0] and "MB/s" in progress[0]
    for flags, message in [
        (["--split-sentences"], "--split-sentences is not supported"),
        (["--partitions", "4"], "--partitions is not supported"),
        (["--dataset-impl", "lazy"], "only 'mmap'"),
    ]:
        assert _run(*base, *flags) == 2
        assert message in capsys.readouterr().err
