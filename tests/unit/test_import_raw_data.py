"""Raw pretraining files in a Megatron blend (data/megatron/raw.py): formats, cache, and the loader.

The reference for every format is `meshforge preprocess` on the same documents as JSON lines: the
conversion must give the same tokens, and the loader on a raw file the same samples as on the
prefix preprocessed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshforge.config import load_config
from meshforge.data.build import LoaderContext, build_train_loader
from meshforge.data.config import TrainDatasetConfig
from meshforge.data.megatron.indexed import IndexedDataset
from meshforge.data.megatron.preprocess import PreprocessOptions, preprocess
from meshforge.data.megatron.raw import convert_raw_entries
from meshforge.data.tokenizer import build_tokenizer
from meshforge.utils.resources import resolve_path

TOKENIZER = str(resolve_path("meshforge://assets/tokenizer"))
CORPUS = resolve_path("meshforge://assets/corpus/python_docstrings.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:60]
    # single-line documents, so that the .txt form (one document per line) holds the same ones
    return [json.loads(line)["text"].replace("\n", " ").replace("\r", " ") for line in lines]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, texts) -> IndexedDataset:
    folder = tmp_path_factory.mktemp("ref")
    src = folder / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    preprocess(
        PreprocessOptions(
            input=str(src), output_prefix=str(folder / "ref"), tokenizer=TOKENIZER, append_eod=True
        )
    )
    return IndexedDataset(folder / "ref_text_document")


def _write(path: Path, texts: list[str]) -> Path:
    suffix = path.suffix
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path)
    elif suffix == ".arrow":
        import datasets

        ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
        ds.save_to_disk(str(path.parent / "hf"))
        path = next((path.parent / "hf").glob("*.arrow"))
    elif suffix == ".csv":
        import csv

        with path.open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["n", "text"])
            writer.writeheader()
            for i, text in enumerate(texts):
                writer.writerow({"n": i, "text": text})
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    else:
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    return path


def _convert(entries, tokenizer, lines=None, **kw):
    options = {"append_eod": True, "overwrite_cache": False, "tokenized_path": None, "workers": 1}
    options.update(kw)
    return convert_raw_entries(entries, tokenizer, log=(lines if lines is not None else []).append, **options)


def _tokens(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".csv", ".json", ".jsonl", ".txt"])
def test_every_raw_format_gives_the_preprocess_tokens(tmp_path, tokenizer, texts, reference, suffix):
    raw = _write(tmp_path / f"train{suffix}", texts)
    [prefix] = _convert([str(raw)], tokenizer)
    assert Path(prefix).parent == raw.parent and Path(prefix).name.startswith(raw.stem + "-")
    assert _tokens(prefix) == [reference[i].tolist() for i in range(len(reference))]
    manifest = json.loads(Path(f"{prefix}.json").read_text())
    assert manifest["append_eod"] is True and manifest["documents"] == len(texts)


def test_second_run_reuses_overwrite_rebuilds_and_settings_change_the_key(tmp_path, tokenizer, texts):
    raw = _write(tmp_path / "train.parquet", texts)
    lines: list[str] = []
    [first] = _convert([str(raw)], tokenizer, lines)
    assert any("converting" in line for line in lines)
    stamp = Path(f"{first}.bin").stat().st_mtime_ns
    lines.clear()
    assert _convert([str(raw)], tokenizer, lines) == [first]
    assert any("reusing" in line for line in lines) and not any("converting" in line for line in lines)
    assert Path(f"{first}.bin").stat().st_mtime_ns == stamp
    lines.clear()
    assert _convert([str(raw)], tokenizer, lines, overwrite_cache=True) == [first]
    assert any("converting" in line for line in lines)
    # without EOD: another conversion, one token per document fewer
    [plain] = _convert([str(raw)], tokenizer, append_eod=False)
    assert plain != first
    assert IndexedDataset(first).num_tokens - IndexedDataset(plain).num_tokens == len(texts)
    # changed content: another key, the old conversion is never read for it
    _write(raw, texts[:-1])
    [changed] = _convert([str(raw)], tokenizer)
    assert changed != first and len(IndexedDataset(changed)) == len(texts) - 1


def test_folder_comma_list_weights_prefixes_and_tokenized_path(tmp_path, tokenizer, texts, reference):
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder / "a.jsonl", texts[:30])
    _write(folder / "b.jsonl", texts[30:])
    out = tmp_path / "tok"
    [converted] = _convert([str(folder)], tokenizer, tokenized_path=str(out))
    assert Path(converted).parent == out and Path(converted).name.startswith("shards-")
    assert _tokens(converted) == [reference[i].tolist() for i in range(len(reference))]
    # the folder is not changed, so it converts to the same key again
    assert _convert([str(folder)], tokenizer, tokenized_path=str(out)) == [converted]
    # weights stay in place; a prefix passes through unchanged
    single = _write(tmp_path / "one.txt", texts[:5])
    blend = _convert(["0.3", str(single), "0.7", converted], tokenizer)
    assert blend[0] == "0.3" and blend[2] == "0.7" and blend[3] == converted
    assert Path(blend[1]).name.startswith("one-")


def test_raw_data_needs_a_tokenizer(tmp_path, texts):
    raw = _write(tmp_path / "train.jsonl", texts)
    with pytest.raises(ValueError, match="raw data, which needs a tokenizer"):
        _convert([str(raw)], None)


def test_a_malformed_record_names_the_file(tmp_path, tokenizer):
    raw = tmp_path / "bad.jsonl"
    raw.write_text('{"text": "fine"}\n{"txt": "no text key"}\n', encoding="utf-8")
    with pytest.raises(ValueError) as err:
        _convert([str(raw)], tokenizer)
    assert "bad.jsonl" in str(err.value) and "missing key 'text'" in str(err.value)
    assert not list(tmp_path.glob("bad-*"))  # nothing half-written is left for a later run


def _loader_batches(cfg: TrainDatasetConfig, tokenizer, steps: int = 6):
    loader = build_train_loader(
        cfg,
        LoaderContext(
            tokenizer=tokenizer, local_batch_size=2, dp_rank=0, dp_size=1, seed=3, total_steps=steps
        ),
    )
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def test_the_loader_reads_a_raw_file_as_its_preprocessed_prefix(tmp_path, tokenizer, texts, reference):
    raw = _write(tmp_path / "train.parquet", texts)

    def cfg(data_path: str, cache: str) -> TrainDatasetConfig:
        return TrainDatasetConfig.model_validate(
            {
                "dataloader": {
                    "type": "BlendedMegatronDatasetDataLoader",
                    "config": {
                        "seq_length": 32,
                        "data_path": [data_path],
                        "append_eod": True,
                        "path_to_cache": str(tmp_path / cache),
                    },
                }
            }
        )

    from_raw = _loader_batches(cfg(str(raw), "c1"), tokenizer)
    from_prefix = _loader_batches(cfg(str(reference.prefix), "c2"), tokenizer)
    for a, b in zip(from_raw, from_prefix, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key


def test_mindspeed_dataset_file_name_forms_import_to_the_blend(tmp_path):
    base = (
        "model:\n  model_name_or_path: /m\n  model_id: qwen3\ndata:\n  data_manager_type: mg\n  cutoff_len: 64\n"
        "  overwrite_cache: true\n  tokenized_path: ./tok\n  preprocessing_num_workers: 2\n  append_eod: 1\n"
        "training:\n  stage: pt\n  output_dir: ./o\n  max_steps: 2\n"
    )
    cases = {
        '  dataset: {file_name: "./a.parquet,./b.parquet"}\n': ["./a.parquet", "./b.parquet"],
        "  dataset:\n    file_name: [./a.parquet, ./c]\n": ["./a.parquet", "./c"],
        "  dataset: ./a.parquet\n": "./a.parquet",
    }
    for line, expected in cases.items():
        path = tmp_path / "ms.yaml"
        path.write_text(base.replace("data:\n", "data:\n" + line), encoding="utf-8")
        config = load_config(path).train_dataset.dataloader.model_extra["config"]
        assert config["data_path"] == expected
        assert config["overwrite_cache"] is True and config["tokenized_path"] == "./tok"
        assert config["preprocessing_num_workers"] == 2 and config["append_eod"] is True
    path.write_text(
        base.replace("data:\n", "data:\n  dataset: {file_name: ./a.parquet, formatting: alpaca}\n")
    )
    with pytest.raises(Exception, match="file_name"):
        load_config(path)


@pytest.mark.procs  # spawns tokenizer worker processes
def test_worker_processes_write_the_same_files(tmp_path, tokenizer, texts):
    raw = _write(tmp_path / "train.jsonl", texts * 3)
    [one] = _convert([str(raw)], tokenizer, tokenized_path=str(tmp_path / "w1"))
    [two] = _convert([str(raw)], tokenizer, tokenized_path=str(tmp_path / "w2"), workers=2)
    assert Path(one).name == Path(two).name  # the worker count is not part of the key
    assert Path(f"{one}.bin").read_bytes() == Path(f"{two}.bin").read_bytes()
    assert Path(f"{one}.idx").read_bytes() == Path(f"{two}.idx").read_bytes()
