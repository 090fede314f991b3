"""Tokenizer loading, TextDataLoader options, and the packed text dataset (boundaries, EOD, errors, counts)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshforge.data.specs import LOADERS, check_dataloader_options, parse_dataloader_options
from meshforge.data.text import TextDataset, list_text_files
from meshforge.data.text_specs import TextDataLoaderOptions
from meshforge.data.tokenizer import build_tokenizer, eod_token_id
from meshforge.utils.resources import data_root

DOCS = ["The first document.", "A second one, a little longer than the first.", "Third: 12345!"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("meshforge://assets/tokenizer")


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def parse_text_options(options: dict) -> TextDataLoaderOptions:
    parsed = parse_dataloader_options("TextDataLoader", options)
    assert isinstance(parsed, TextDataLoaderOptions)
    return parsed


def _opts(paths, seq_length: int = 8, **kw) -> TextDataLoaderOptions:
    return parse_text_options({"data_path": paths, "seq_length": seq_length, **kw})


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- tokenizer -------------------------------------------------------------------------------------


def test_build_tokenizer_bundled_and_cwd_relative(tok, tmp_path, monkeypatch):
    assert len(tok) == 8192 and eod_token_id(tok) == 0
    shutil.copytree(data_root() / "assets" / "tokenizer", tmp_path / "mytok")
    monkeypatch.chdir(tmp_path)
    local = build_tokenizer("mytok")
    assert local("def f(): pass")["input_ids"] == tok("def f(): pass")["input_ids"]


def test_build_tokenizer_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_tok"):
        build_tokenizer(str(tmp_path / "no_such_tok"))
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen3-0.6B"):
        build_tokenizer("Qwen/Qwen3-0.6B")  # a hub name is never downloaded


class _Vocab:
    def __init__(self, vocab: dict, eos: int | None):
        self._vocab, self.eos_token_id = vocab, eos

    def get_vocab(self) -> dict:
        return self._vocab


def test_eod_token_choice():
    assert eod_token_id(_Vocab({"<|endoftext|>": 5, "</s>": 2}, eos=2)) == 5
    assert eod_token_id(_Vocab({"</s>": 2}, eos=2)) == 2
    with pytest.raises(ValueError, match="append_eod"):
        eod_token_id(_Vocab({"a": 0}, eos=None))


# --- options -----------------------------------------------------------------------------------------


def test_options_valid_and_coerced():
    assert check_dataloader_options("TextDataLoader", {"data_path": "a.jsonl", "seq_length": 16}) == []
    opts = parse_text_options(
        {"data_path": "a.jsonl", "seq_length": "16", "type": "TextDataLoader", "shuffle": True}
    )
    assert (
        opts.data_path == ["a.jsonl"]
        and opts.seq_length == 16
        and opts.text_key == "text"
        and opts.append_eod
    )
    assert LOADERS["TextDataLoader"].options is TextDataLoaderOptions


@pytest.mark.parametrize(
    ("options", "key", "fragment"),
    [
        ({"data_path": "a", "seq_lenght": 8}, "seq_lenght", "did you mean 'seq_length'"),
        ({"data_path": "a"}, "seq_length", "required"),
        ({"seq_length": 8}, "data_path", "required"),
        ({"data_path": "a", "seq_length": 0}, "seq_length", "greater than 0"),
        ({"data_path": "a", "seq_length": True}, "seq_length", "positive integer"),
        ({"data_path": "a", "seq_length": 2.5}, "seq_length", "integer"),
        ({"data_path": ["a", 3], "seq_length": 8}, "data_path[1]", "string"),
        ({"data_path": ["a", ""], "seq_length": 8}, "data_path[1]", "at least 1"),
        ({"data_path": [], "seq_length": 8}, "data_path", "at least one"),
        ({"data_path": {"x": 1}, "seq_length": 8}, "data_path", "list of paths"),
        ({"data_path": "a", "seq_length": 8, "append_eod": "yes"}, "append_eod", "boolean"),
        ({"data_path": "a", "seq_length": 8, "text_key": ""}, "text_key", "at least 1"),
    ],
)
def test_options_issues_name_the_key(options, key, fragment):
    issues = check_dataloader_options("TextDataLoader", options)
    assert any(k == key and fragment in reason for k, reason in issues), issues
    with pytest.raises(ValueError) as info:
        parse_text_options(options)
    assert f"train_dataset.dataloader.{key}: " in str(info.value)


def test_loader_type_issues():
    assert check_dataloader_options(None, {}) == [
        (
            "type",
            "no data loader type given: set it to one of the built loaders: "
            "TextDataLoader, BlendedMegatronDatasetDataLoader, SFTDataLoader",
        )
    ]
    # The Megatron loader is built: an empty `config` names its required keys by path.
    keys = {key for key, _ in check_dataloader_options("BlendedMegatronDatasetDataLoader", {"config": {}})}
    assert {"config.data_path", "config.seq_length"} <= keys
    [(key, reason)] = check_dataloader_options("SomeOtherLoader", {})
    assert key == "type" and reason.startswith("not supported yet")
    assert "TextDataLoader" in reason and "BlendedMegatronDatasetDataLoader" in reason
    [(_, reason)] = check_dataloader_options("TextDataloader", {})
    assert "did you mean 'TextDataLoader'" in reason


@pytest.mark.procs
def test_specs_import_is_light():
    code = "import sys, meshforge.data.specs; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# --- dataset: sample boundaries ------------------------------------------------------------------------


def test_megatron_sample_boundaries():
    stream = np.arange(100, 123, dtype=np.int32)  # 23 tokens
    ds = TextDataset(stream, seq_length=5)
    assert len(ds) == (23 - 1) // 5 == 4
    batch = ds.get_batch(np.array([0, 1, 3]))
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 5)
    np.testing.assert_array_equal(batch["input_ids"][0], np.arange(100, 105))
    np.testing.assert_array_equal(batch["labels"][0], np.arange(101, 106))  # shifted by one
    np.testing.assert_array_equal(batch["input_ids"][2], np.arange(115, 120))
    # consecutive samples share one token: the last target of i is the first input of i + 1
    assert batch["labels"][0][-1] == batch["input_ids"][1][0] == 105
    assert ds[3]["labels"][-1] == 120  # the last usable token; 121 and 122 are the tail
    with pytest.raises(IndexError):
        ds.get_batch(np.array([4]))


def test_eod_after_every_document_and_summary(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    lines: list[str] = []
    ds = TextDataset.from_options(_opts(str(path), seq_length=4), tok, log=lines.append)
    expected = [t for d in DOCS for t in [*_ids(tok, d), 0]]
    np.testing.assert_array_equal(ds.stream, np.asarray(expected, dtype=np.int32))
    assert ds.stream.dtype == np.int32
    s = ds.summary
    assert (s.files, s.documents, s.empty_documents, s.tokens) == (1, 3, 0, len(expected))
    assert s.samples == len(ds) == (len(expected) - 1) // 4
    assert s.tail_tokens == len(expected) - (s.samples * 4 + 1)
    assert len(lines) == 1 and f"{s.samples:,} samples" in lines[0] and f"{s.tokens:,} tokens" in lines[0]
    assert f"{s.tail_tokens:,} tail tokens" in lines[0]
    # every token except the first is a target exactly once
    labels = np.concatenate([ds[i]["labels"] for i in range(len(ds))])
    np.testing.assert_array_equal(labels, ds.stream[1 : s.samples * 4 + 1])


def test_no_eod_and_custom_text_key(tok, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": d} for d in DOCS])
    ds = TextDataset.from_options(_opts(str(path), seq_length=4, text_key="body", append_eod=False), tok)
    np.testing.assert_array_equal(ds.stream, [t for d in DOCS for t in _ids(tok, d)])


def test_formats_folders_and_order(tok, tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    _jsonl(folder / "b.jsonl", [{"text": DOCS[1]}, {"text": ""}])  # empty document: skipped, counted
    (folder / "a.json").write_text(json.dumps([{"text": DOCS[0]}]), encoding="utf-8")
    (folder / "sub" / "c.txt").write_text(f"{DOCS[2]}\n\n{DOCS[0]}\r\n", encoding="utf-8")
    (folder / ".hidden" / "x.jsonl").write_text("not json\n")
    (folder / "notes.md").write_text("ignored: not a data extension")
    extra = _jsonl(tmp_path / "extra.jsonl", [{"text": DOCS[2]}])
    files = list_text_files([str(folder), str(extra)])
    assert [f.name for f in files] == ["a.json", "b.jsonl", "c.txt", "extra.jsonl"]
    ds = TextDataset.from_options(_opts([str(folder), str(extra)], seq_length=4), tok)
    order = [DOCS[0], DOCS[1], DOCS[2], DOCS[0], DOCS[2]]
    np.testing.assert_array_equal(ds.stream, [t for d in order for t in [*_ids(tok, d), 0]])
    assert (ds.summary.files, ds.summary.documents, ds.summary.empty_documents) == (4, 5, 1)


# --- dataset: errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "where", "fragment"),
    [
        ('{"text": "ok"}\n\n{"text": broken}\n', ":3:", "not valid JSON"),
        ('{"text": "ok"}\n{"txt": "x"}\n', ":2:", "no key 'text'"),
        ('{"text": 5}\n', ":1:", "must be a string"),
        ('["text"]\n', ":1:", "expected a JSON object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tok, tmp_path, content, where, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl") as info:
        TextDataset.from_options(_opts(str(path)), tok)
    assert f"{path}{where}" in str(info.value) and fragment in str(info.value)


def test_malformed_json_and_encoding(tok, tmp_path):
    not_list = tmp_path / "obj.json"
    not_list.write_text('{"text": "x"}')
    with pytest.raises(ValueError, match="list of objects"):
        TextDataset.from_options(_opts(str(not_list)), tok)
    bad_item = tmp_path / "items.json"
    bad_item.write_text('[{"text": "x"}, {"text": null}]')
    with pytest.raises(ValueError, match=r"items\.json: item 1: 'text' must be a string"):
        TextDataset.from_options(_opts(str(bad_item)), tok)
    bad_syntax = tmp_path / "syntax.json"
    bad_syntax.write_text('[\n{"text": "x"},\n{oops}\n]')
    with pytest.raises(ValueError, match=r"syntax\.json:3: not valid JSON"):
        TextDataset.from_options(_opts(str(bad_syntax)), tok)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        TextDataset.from_options(_opts(str(latin)), tok)


def test_missing_paths_and_short_data(tok, tmp_path):
    ok = _jsonl(tmp_path / "ok.jsonl", [{"text": d} for d in DOCS])
    with pytest.raises(FileNotFoundError, match=r"data_path\[1\].*missing\.jsonl"):
        list_text_files([str(ok), str(tmp_path / "missing.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data_path\[0\].*holds no"):
        list_text_files([str(tmp_path / "empty")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data_path\[0\].*x\.csv"):
        list_text_files([str(tmp_path / "x.csv")])
    with pytest.raises(ValueError, match="fewer than seq_length"):
        TextDataset.from_options(_opts(str(ok), seq_length=4096), tok)


def test_loader_without_tokenizer_is_refused(tmp_path):
    from meshforge.data.build import LoaderContext, build_train_loader
    from meshforge.data.config import TrainDatasetConfig

    ok = _jsonl(tmp_path / "ok.jsonl", [{"text": d} for d in DOCS])
    cfg = TrainDatasetConfig.model_validate(
        {"dataloader": {"type": "TextDataLoader", "data_path": [str(ok)], "seq_length": 8}}
    )
    ctx = LoaderContext(tokenizer=None, local_batch_size=1, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="TextDataLoader: the run has no tokenizer"):
        build_train_loader(cfg, ctx)


def test_bundled_corpus_packs(tok):
    lines: list[str] = []
    opts = _opts("meshforge://assets/corpus/python_docstrings.jsonl", seq_length=256)
    ds = TextDataset.from_options(opts, tok, log=lines.append)
    assert ds.summary.documents > 5000 and len(ds) > 1000
    assert ds.summary.tokens == int((ds.stream == 0).sum()) + int((ds.stream != 0).sum())
    assert int((ds.stream == 0).sum()) == ds.summary.documents  # one EOD per document
    assert "text data: 1 file(s)" in lines[0]


def test_sft_loader_options_point_to_train_dataset_fields():
    from meshforge.data.config import TrainDatasetConfig

    [(key, reason)] = check_dataloader_options(
        "SFTDataLoader", {"cutoff_len": 5}, section_fields=TrainDatasetConfig.model_fields
    )
    assert key == "cutoff_len" and "train_dataset.cutoff_len" in reason
