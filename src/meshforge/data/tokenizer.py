"""Load the Hugging Face tokenizer a run needs, from a local folder only.

Training must never stall on, or silently depend on, a network download: a tokenizer is always a
folder on disk (`meshforge://assets/tokenizer` names the bundled demo one). This module also picks
the end-of-document token that the pretraining loader appends after each document.
"""

from __future__ import annotations

from typing import Any

from meshforge.resources import resolve_path

EOD_TOKEN = "<|endoftext|>"


def build_tokenizer(name_or_path: str, *, use_fast: bool = True, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer from a local folder without touching the network.

    Args:
        name_or_path: a folder holding `tokenizer.json` / `tokenizer_config.json` (or the slow
            tokenizer files); `meshforge://assets/tokenizer` is the bundled demo tokenizer, any other
            relative path resolves against the working directory.
        use_fast: load the Rust-backed tokenizer (the data pipeline needs it for batch speed).
        trust_remote_code: allow custom tokenizer classes shipped as code in the folder.

    Returns:
        The Hugging Face tokenizer (a `PreTrainedTokenizerBase`).

    Raises:
        FileNotFoundError: when the folder does not exist (hub names are not downloaded).
    """
    path = resolve_path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder not found: {name_or_path!r} (resolved to {path}); give a local folder "
            "with tokenizer.json, e.g. meshforge://assets/tokenizer (hub names are never downloaded)"
        )
    # Imported here: transformers is heavy and config validation must not pay for it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), use_fast=use_fast, trust_remote_code=trust_remote_code, local_files_only=True
    )


def eod_token_id(tokenizer: Any) -> int:
    """The id that ends a document in a packed token stream.

    `<|endoftext|>` when the vocabulary has it (Qwen, GPT-2 style and the bundled tokenizer: it is
    not the chat EOS, so pretraining documents do not look like finished chat turns), else the
    tokenizer's `eos_token_id`.

    Raises:
        ValueError: when the tokenizer has neither.
    """
    vocab = tokenizer.get_vocab()
    if EOD_TOKEN in vocab:
        return int(vocab[EOD_TOKEN])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return int(eos)
    raise ValueError(
        f"the tokenizer has neither {EOD_TOKEN!r} nor an eos_token: cannot mark document ends; "
        "set eos_token in its tokenizer_config.json or set append_eod: false in the dataloader"
    )
