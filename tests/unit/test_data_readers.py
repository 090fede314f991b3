"""Broken data files end in one ValueError naming the file and what is wrong (the CLI prints it as
one `error:` line): Megatron .idx/.bin, tokenizer folders, dataset_info.json."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshforge.data.megatron.indexed import IndexedDataset, IndexedDatasetWriter

IDX_HEADER = 34  # magic, version, dtype code, sequence and document counts


def _corpus(tmp_path: Path) -> tuple[Path, bytes, bytes]:
    prefix = tmp_path / "c_text_document"
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for i in range(4):
            w.add_document(np.arange(10) + i)
    return prefix, Path(f"{prefix}.idx").read_bytes(), Path(f"{prefix}.bin").read_bytes()


def _corrupt_pointer(idx: bytes) -> bytes:
    # sequence 1's byte offset (after 4 int32 lengths and sequence 0's int64 pointer) far past the .bin
    raw = bytearray(idx)
    at = IDX_HEADER + 4 * 4 + 8
    raw[at : at + 8] = (10**6).to_bytes(8, "little")
    return bytes(raw)


def _corrupt_documents(idx: bytes) -> bytes:
    raw = bytearray(idx)
    at = IDX_HEADER + 4 * 4 + 4 * 8 + 8  # document_indices[1]
    raw[at : at + 8] = (99).to_bytes(8, "little")
    return bytes(raw)


@pytest.mark.parametrize(
    ("case", "which", "fragment"),
    [
        ("empty idx", ".idx", "too short for a Megatron index header (0 bytes)"),
        ("header only", ".idx", "truncated"),
        ("bad pointer", ".idx", "sequence 1 points at bytes [1000000, 1000040) outside"),
        ("bad documents", ".idx", "document indices must rise from 0"),
        ("short bin", ".bin", "the .bin and .idx do not match"),
    ],
)
def test_indexed_reader_names_the_broken_file(tmp_path, case, which, fragment):
    prefix, idx, bin_ = _corpus(tmp_path)
    idx_out, bin_out = {
        "empty idx": (b"", bin_),
        "header only": (idx[:IDX_HEADER], bin_),
        "bad pointer": (_corrupt_pointer(idx), bin_),
        "bad documents": (_corrupt_documents(idx), bin_),
        "short bin": (idx, bin_[:30]),
    }[case]
    Path(f"{prefix}.idx").write_bytes(idx_out)
    Path(f"{prefix}.bin").write_bytes(bin_out)
    with pytest.raises(ValueError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert message.startswith(f"{prefix}{which}: ") and fragment in message
    assert "\n" not in message


def _tokenizer_copy(tmp_path: Path) -> Path:
    from meshforge.utils.resources import resolve_path

    folder = tmp_path / "tok"
    shutil.copytree(resolve_path("meshforge://assets/tokenizer"), folder)
    return folder


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, ":1: not valid JSON"),  # truncated to half its length
        (b"", ":1: not valid JSON"),
        (b"\xff\xfe\x00", ": not UTF-8 text"),
        (b'{"model": 3}', ": not a tokenizer Hugging Face can load"),
    ],
)
def test_tokenizer_reader_names_the_broken_file(tmp_path, content, fragment):
    from meshforge.data.tokenizer import build_tokenizer

    folder = _tokenizer_copy(tmp_path)
    path = folder / "tokenizer.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content is None else content)
    with pytest.raises(ValueError) as info:
        build_tokenizer(str(folder))
    message = str(info.value)
    assert message.startswith(str(path)) and fragment in message and "\n" not in message


def test_tokenizer_config_json_is_checked_too(tmp_path):
    from meshforge.data.tokenizer import build_tokenizer

    folder = _tokenizer_copy(tmp_path)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 8,\n  "oops"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json:3: not valid JSON"):
        build_tokenizer(str(folder))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'{"a": ', ":1: not valid JSON"),
        (b"\xff\xfe", ": not UTF-8 text"),
        (b"[1]", ": must hold an object of dataset names"),
        (b'{"a": 3}', ": a: a dataset must be an object with file_name"),
    ],
)
def test_dataset_info_reader_names_the_broken_file(tmp_path, content, fragment):
    from meshforge.data.sft.dataset_info import resolve_datasets

    (tmp_path / "dataset_info.json").write_bytes(content)
    with pytest.raises(ValueError) as info:
        resolve_datasets("a", str(tmp_path))
    message = str(info.value)
    assert message.startswith(str(tmp_path / "dataset_info.json")) and fragment in message


@pytest.mark.procs
def test_cli_reports_a_corrupt_index_in_one_line(tmp_path):
    prefix, idx, _ = _corpus(tmp_path)
    Path(f"{prefix}.idx").write_bytes(_corrupt_pointer(idx))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    args = [
        sys.executable,
        "-m",
        "meshforge",
        "data",
        "preview",
        "--config",
        str(Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"),
        f"--train_dataset.dataloader.config.data_path=[{prefix}]",
        f"--train_dataset.dataloader.config.path_to_cache={tmp_path / 'cache'}",
        "--train_dataset.dataloader.config.seq_length=4",
        "--training.local_batch_size=1",
        "--training.global_batch_size=1",
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"{prefix}.idx: sequence 1 points at bytes" in errors[0], done.stderr
