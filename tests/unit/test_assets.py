"""The bundled corpus and tokenizer: well-formed, documented, offline-loadable, exact, reproducible."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshforge.utils.resources import data_root, resolve_path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
CORPUS = ASSETS / "corpus" / "python_docstrings.jsonl"
CONVERSATIONS = ASSETS / "corpus" / "conversations.jsonl"
TOKENIZER = ASSETS / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


def _load_build_script():
    spec = importlib.util.spec_from_file_location(
        "build_assets", ASSETS.parent / "scripts" / "build_assets.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_are_small_and_documented():
    files = sorted(p for p in ASSETS.rglob("*") if p.is_file())
    readme = (ASSETS / "README.md").read_text()
    assert {p.name for p in files} >= {"python_docstrings.jsonl", "conversations.jsonl", "tokenizer.json"}
    for path in files:
        assert path.stat().st_size < 5 * 2**20, path
        if path.name != "README.md":
            assert str(path.relative_to(ASSETS)) in readme, f"{path} is not described in assets/README.md"
    corpus_bytes = CORPUS.stat().st_size + CONVERSATIONS.stat().st_size
    assert 2 * 10**6 <= corpus_bytes <= 4 * 10**6
    for licence in ("PSF", "BSD", "LICENSE.python.txt", "scripts/build_assets.py"):
        assert licence in readme


def test_bundled_paths_resolve():
    assert resolve_path("meshforge://assets/tokenizer") == data_root() / "assets" / "tokenizer"
    assert (data_root() / "assets" / "tokenizer" / "tokenizer.json").is_file()


def test_corpus_records():
    texts = []
    with CORPUS.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            assert list(record) == ["text"] and isinstance(record["text"], str) and record["text"].strip()
            texts.append(record["text"])
    assert len(texts) == len(set(texts)) > 5000
    assert not any(tok in t for t in texts for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))


def test_conversation_records():
    count = 0
    with CONVERSATIONS.open(encoding="utf-8") as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            assert len(turns) >= 2 and len(turns) % 2 == 0
            # A string split into one-character turns (a malformed source entry) is not a dialogue.
            assert sum(len(t["value"]) == 1 for t in turns) <= len(turns) // 2, turns[:4]
            for i, turn in enumerate(turns):
                assert turn["from"] == ("human" if i % 2 == 0 else "gpt")
                assert isinstance(turn["value"], str) and turn["value"]
            count += 1
    assert count > 500


def test_tokenizer_specials_and_settings(tokenizer):
    assert len(tokenizer) == 8192
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 2048
    # nothing is added around plain text
    ids = tokenizer("hello world")["input_ids"]
    assert ids == tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert 0 not in ids and 1 not in ids and 2 not in ids


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x ** 2  # square\n",
        "  leading and trailing spaces  \n\n\ttabs\r\nand CRLF",
        "Numbers 1234567890 and 3.14e-10, unicode: ünïcødé, 中文, emoji 🙂, zero-width \u200b.",
        "",
        " ",
    ],
)
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_corpus_sample(tokenizer):
    with CORPUS.open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(200), f)]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tokenizer.batch_decode(encoded) == texts
    # a trained BPE compresses English prose well below one token per 2 characters
    assert sum(map(len, encoded)) < sum(map(len, texts)) / 2.5


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    encoded = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert list(ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and list(ids).count(2) == 1


def test_tokenizer_rebuilds_byte_identical(tmp_path):
    """Training on the shipped corpus files reproduces the shipped tokenizer files exactly."""
    build = _load_build_script()
    with CORPUS.open(encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    with CONVERSATIONS.open(encoding="utf-8") as f:
        chat = [turn["value"] for line in f for turn in json.loads(line)["conversations"]]
    build.train_tokenizer(docs + chat, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER / name).read_bytes(), name


def test_build_script_filters_and_dedupes():
    build = _load_build_script()
    assert build.dedupe(["a", "b", "a", "c", "b"]) == ["a", "b", "c"]
    assert build._skip_module(Path("test/test_os.py"))
    assert build._skip_module(Path("idlelib/editor.py"))
    assert build._skip_module(Path("unittest/test/test_case.py"))
    assert build._skip_module(Path("encodings/cp1252.py"))
    assert not build._skip_module(Path("json/__init__.py"))
    assert build._english_enough("plain English text")
    assert not build._english_enough("Это не английский текст вообще")
