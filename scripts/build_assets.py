#!/usr/bin/env python3
"""Rebuild meshforge's bundled demo assets: the text corpus, the conversation set and the tokenizer.

Why a script: the files under `assets/` are generated, and anyone must be able to regenerate them
byte for byte and see exactly what went into them. Running it twice on the same machine writes the
same bytes (sorted inputs, no timestamps, a single-threaded tokenizer trainer).

Sources (see assets/README.md for licences):
- `assets/corpus/python_docstrings.jsonl`: the docstrings of the CPython 3.11 standard library that
  runs this script (PSF License 2.0), one document per docstring, plus the `pydoc_data` help topics
  (the language reference text that `help()` shows), one document per topic.
- `assets/corpus/conversations.jsonl`: the English part of the `chatterbot-corpus` wheel from PyPI
  (BSD), one multi-turn conversation per line in sharegpt form.
- `assets/tokenizer/`: a byte-level BPE tokenizer (vocab 8192) trained on both, with a ChatML
  chat template, saved as a Hugging Face fast tokenizer folder.

Usage:
    python scripts/build_assets.py [--chatterbot-wheel PATH] [--out assets]

Without `--chatterbot-wheel` the wheel is fetched with `pip download --no-deps chatterbot-corpus==1.3.3`
(the only network access; the other sources are on the machine).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

# The trainer parallelises pair counting with rayon; one thread keeps merge tie-breaking (and hence
# the bytes of tokenizer.json) identical from run to run. Must be set before tokenizers is imported.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")

CHATTERBOT_VERSION = "1.3.3"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 in this order
MODEL_MAX_LENGTH = 2048

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs and
# whitespace, so numbers are spelled digit by digit and words keep their leading space.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen writes it, without Qwen's default system message: each message is
# `<|im_start|>{role}\n{content}<|im_end|>\n`, and the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Stdlib folders left out: tests, tools and demos (idlelib, lib2to3, turtledemo), generated codec
# tables (encodings), bundled third-party or binary content, and pydoc_data (added as topics).
SKIP_DIRS = {
    "__pycache__",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "encodings",
    "ensurepip",
    "site-packages",
    "lib-dynload",
    "pydoc_data",
    "test",
    "tests",
}
MIN_DOC_CHARS = 40  # shorter docstrings ("Return self.") carry almost no language
MAX_NON_ASCII = 0.02  # share of non-ASCII characters above which a docstring counts as non-English


def _skip_module(rel: Path) -> bool:
    parts = rel.parts
    if any(p in SKIP_DIRS for p in parts[:-1]):
        return True
    if parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata"):
        return True
    # test modules: test_*.py, *_test.py, testing helpers such as `_test_multiprocessing.py`
    name = parts[-1][:-3]
    return name.startswith(("test_", "_test")) or name.endswith("_test") or name == "__phello__"


def _english_enough(text: str) -> bool:
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    return non_ascii <= MAX_NON_ASCII * len(text)


def collect_docstrings(stdlib: Path) -> list[str]:
    """Docstrings of modules, classes and functions of the stdlib, in sorted file then AST order."""
    docs: list[str] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _skip_module(rel):
            continue
        tree = ast.parse(path.read_bytes(), filename=str(rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=True)
                if text and len(text) >= MIN_DOC_CHARS and _english_enough(text):
                    docs.append(text.strip())
    return docs


def collect_help_topics() -> list[str]:
    """The `pydoc_data.topics` texts (the language reference pages behind `help('assert')`)."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def dedupe(texts: list[str]) -> list[str]:
    """Drop exact repeats, keeping the first occurrence (order stays deterministic)."""
    seen: set[str] = set()
    out = []
    for text in texts:
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def fetch_chatterbot(dest: Path) -> Path:
    """Download the chatterbot-corpus wheel (no dependencies) into `dest` and return its path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
        + [f"chatterbot-corpus=={CHATTERBOT_VERSION}", "-d", str(dest)],
        check=True,
    )
    wheels = sorted(dest.glob("chatterbot_corpus-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download did not leave a chatterbot_corpus wheel in {dest}")
    return wheels[0]


def collect_conversations(wheel: Path) -> list[dict]:
    """English conversations of the chatterbot corpus as sharegpt records (human/gpt alternating)."""
    import yaml

    records = []
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(
            n for n in zf.namelist() if n.startswith("chatterbot_corpus/data/english/") and n.endswith(".yml")
        )
        for name in names:
            data = yaml.safe_load(zf.read(name).decode("utf-8"))
            for turns in data.get("conversations") or []:
                if not isinstance(turns, list):
                    # A malformed entry (one string instead of a list of turns) would otherwise be
                    # iterated character by character into one-letter turns.
                    continue
                values = [str(t).strip() for t in turns if t is not None and str(t).strip()]
                if len(values) < 2:
                    continue
                conv = [
                    {"from": "human" if i % 2 == 0 else "gpt", "value": value}
                    for i, value in enumerate(values)
                ]
                # a dialogue must end on the assistant's turn to be usable for SFT
                if conv[-1]["from"] != "gpt":
                    conv = conv[:-1]
                records.append({"conversations": conv})
    seen: set[str] = set()
    unique = []
    for rec in records:
        key = json.dumps(rec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(rec)
    return unique


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Train the byte-level BPE and write `tokenizer.json` and `tokenizer_config.json`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets on the raw bytes; no special tokens are added (no BOS/EOS).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # byte-level BPE decodes exactly; the legacy space clean-up would break round trips
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, name in enumerate(SPECIAL_TOKENS)
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "assets")
    parser.add_argument("--chatterbot-wheel", type=Path, default=None, help="a downloaded wheel")
    args = parser.parse_args(argv)

    if sys.version_info[:2] != (3, 11):
        print(f"warning: the shipped assets come from CPython 3.11; this is {sys.version.split()[0]}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = dedupe(collect_docstrings(stdlib) + collect_help_topics())

    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.chatterbot_wheel or fetch_chatterbot(Path(tmp))
        conversations = collect_conversations(wheel)

    corpus_dir = args.out / "corpus"
    write_jsonl(corpus_dir / "python_docstrings.jsonl", [{"text": t} for t in docs])
    write_jsonl(corpus_dir / "conversations.jsonl", conversations)
    shutil.copyfile(stdlib / "LICENSE.txt", corpus_dir / "LICENSE.python.txt")

    # The tokenizer also sees the dialogue turns, so chat text is not all rare merges.
    chat_texts = [turn["value"] for rec in conversations for turn in rec["conversations"]]
    train_tokenizer(docs + chat_texts, args.out / "tokenizer")

    for path in sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "README.md"):
        print(f"{path.relative_to(args.out)}  {path.stat().st_size:>9,d} B  sha256 {_sha256(path)[:16]}")
    print(f"{len(docs)} documents, {len(conversations)} conversations (python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
