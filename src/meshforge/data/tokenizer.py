"""Load the Hugging Face tokenizer a run needs, from a local folder only, and extend it.

Training must never stall on, or silently depend on, a network download: a tokenizer is always a
folder on disk (`meshforge://assets/tokenizer` names the bundled demo one). This module also picks
the end-of-document token that the pretraining loader appends after each document.

Vocabulary extension follows the MindSpeed-LLM / LLaMA-Factory model arguments:
`split_special_tokens`, `add_tokens` (ordinary tokens), `add_special_tokens` and
`new_special_tokens_config` (a YAML or JSON mapping ``token -> description``; when given, its keys
replace `add_special_tokens` and its descriptions drive the `desc_init` row initialisation).
Ordinary tokens are added first, then special ones, as LLaMA-Factory does. What was added is
recorded on the tokenizer (`tokenizer_extension`) so that `meshforge.models.vocab.vocab_plan`
can size the embedding and initialise the new rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from meshforge.utils.resources import resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOD_TOKEN = "<|endoftext|>"
# The attribute of a Hugging Face tokenizer that holds its `TokenizerExtension`.
_EXTENSION_ATTR = "meshforge_extension"


@dataclass(frozen=True)
class TokenizerExtension:
    """What `extend_tokenizer` added to a tokenizer.

    Attributes:
        tokens: ordinary tokens requested (`add_tokens`), in order.
        special_tokens: special tokens requested (`add_special_tokens`, or the keys of
            `new_special_tokens_config`), in order.
        new_ids: token -> id for every requested token that got a new id (tokens already in the
            vocabulary keep theirs and are not listed).
        descriptions: token -> description text from `new_special_tokens_config` (empty without it).
        size_before: `len(tokenizer)` before anything was added.
    """

    tokens: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    new_ids: dict[str, int] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    size_before: int = 0

    @property
    def num_added(self) -> int:
        """How many tokens got a new id (the growth of `len(tokenizer)`)."""
        return len(self.new_ids)

    @property
    def requested(self) -> bool:
        """True when any token was asked for (LLaMA-Factory then turns `resize_vocab` on)."""
        return bool(self.tokens or self.special_tokens)


# JSON files of a tokenizer folder, checked first so that a broken one is named with its line.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def _check_json(path: Path) -> None:
    """Raise ValueError naming `path` (and the line) when it exists but is not valid UTF-8 JSON."""
    if not path.is_file():
        return
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {exc.start}); the tokenizer file is corrupt"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); the file is truncated "
            "or corrupt: copy it again from the model's folder"
        ) from None


def refuse_tokenizer_code(path: Path, *, trust_remote_code: bool) -> None:
    """Refuse a tokenizer folder that ships its own Python code, unless `model.trust_remote_code`.

    transformers imports a tokenizer's own code (a `tokenization_*.py` beside it, or a module of
    another repository) through `auto_map`: in `tokenizer_config.json`, or an `AutoTokenizer`
    entry of `config.json`. Such a folder is refused here, before transformers reads it, so that
    whatever transformers' own rules are, a tokenizer folder runs no code unless the run says so.

    Raises:
        ValueError: naming the file and the `auto_map` it holds.
    """
    if trust_remote_code:
        return
    for name in ("tokenizer_config.json", "config.json"):
        file = path / name
        try:
            data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # a broken tokenizer_config.json is named by _check_json, config.json by the model
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if name == "config.json" and not (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map):
            continue
        if auto_map:
            shown = json.dumps(auto_map)
            raise ValueError(
                f"{file}: the tokenizer ships its own code (auto_map: {shown[:120]}); meshforge runs no "
                "code from a model folder unless model.trust_remote_code: true (set it only if you trust "
                f"{path})"
            )


def build_tokenizer(
    name_or_path: str,
    *,
    use_fast: bool = True,
    trust_remote_code: bool = False,
    split_special_tokens: bool = False,
    add_tokens: str | Sequence[str] | None = None,
    add_special_tokens: str | Sequence[str] | None = None,
    new_special_tokens_config: str | Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder without touching the network, and extend it.

    Args:
        name_or_path: a folder holding `tokenizer.json` / `tokenizer_config.json` (or the slow
            tokenizer files); `meshforge://assets/tokenizer` is the bundled demo tokenizer, any other
            relative path resolves against the working directory.
        use_fast: load the Rust-backed tokenizer (the data pipeline needs it for batch speed).
        trust_remote_code: allow custom tokenizer classes shipped as code in the folder
            (`refuse_tokenizer_code` refuses them otherwise).
        split_special_tokens: tokenise special tokens in text as ordinary text (``<|im_end|>``
            becomes several pieces) instead of keeping each one whole.
        add_tokens: ordinary tokens to add (comma-separated string or list; `model.add_tokens`).
        add_special_tokens: special tokens to add (`model.add_special_tokens`); ignored, with a
            logged warning, when `new_special_tokens_config` is given.
        new_special_tokens_config: a YAML/JSON file, or a mapping, of special token -> description.
        log: sink for one line saying what was added (and the warning above).

    Returns:
        The Hugging Face tokenizer (a `PreTrainedTokenizerBase`); `tokenizer_extension(tok)`
        tells what was added.

    Raises:
        FileNotFoundError: when the folder (or `new_special_tokens_config`) does not exist (hub
            names are not downloaded).
        ValueError: for an empty token or a malformed `new_special_tokens_config` (names the key),
            tokenizer files that do not load (names the file, and the line of broken JSON), or a
            tokenizer with code of its own without `trust_remote_code`.
    """
    path = resolve_path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder not found: {name_or_path!r} (resolved to {path}); give a local folder "
            "with tokenizer.json, e.g. meshforge://assets/tokenizer (hub names are never downloaded)"
        )
    # Imported here: transformers is heavy and config validation must not pay for it.
    from transformers import AutoTokenizer

    kwargs = {"split_special_tokens": True} if split_special_tokens else {}
    for name in TOKENIZER_JSON_FILES:
        _check_json(path / name)
    refuse_tokenizer_code(path, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), use_fast=use_fast, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    except Exception as exc:  # the Rust tokenizers library raises bare Exceptions for a bad file
        if isinstance(exc, ImportError):
            raise
        main = path / "tokenizer.json"
        where = main if main.is_file() else path
        raise ValueError(
            f"{where}: not a tokenizer Hugging Face can load ({type(exc).__name__}: {_first_line(exc)}); "
            "replace the tokenizer files with ones saved by save_pretrained"
        ) from None
    if split_special_tokens and not getattr(tokenizer, "split_special_tokens", False):
        raise ValueError(
            f"model.split_special_tokens: the {type(tokenizer).__name__} tokenizer in {path} does not "
            "support splitting special tokens; unset it"
        )
    extend_tokenizer(
        tokenizer,
        add_tokens=add_tokens,
        add_special_tokens=add_special_tokens,
        new_special_tokens_config=new_special_tokens_config,
        log=log,
    )
    return tokenizer


class TokenizerOptions(Protocol):
    """The tokenizer options of the `model:` section (`ModelConfig`), named here so that the data
    package does not import the models package."""

    @property
    def split_special_tokens(self) -> bool: ...
    @property
    def add_tokens(self) -> str | None: ...
    @property
    def add_special_tokens(self) -> str | None: ...
    @property
    def new_special_tokens_config(self) -> str | None: ...


class ExtensionOptions(TypedDict):
    """The keyword arguments of `build_tokenizer` that extend the vocabulary."""

    split_special_tokens: bool
    add_tokens: str | Sequence[str] | None
    add_special_tokens: str | Sequence[str] | None
    new_special_tokens_config: str | Mapping[str, str] | None


def extension_options(model_cfg: TokenizerOptions) -> ExtensionOptions:
    """`build_tokenizer` keyword arguments from the `model:` section's tokenizer options.

    ``build_tokenizer(path, use_fast=..., **extension_options(cfg.model), log=...)`` extends the
    tokenizer the same way wherever a run's tokenizer is rebuilt (training, conversion).
    """
    return {
        "split_special_tokens": model_cfg.split_special_tokens,
        "add_tokens": model_cfg.add_tokens,
        "add_special_tokens": model_cfg.add_special_tokens,
        "new_special_tokens_config": model_cfg.new_special_tokens_config,
    }


def parse_token_list(value: str | Sequence[str] | None, *, key: str) -> list[str]:
    """Tokens from a comma-separated string (surrounding spaces stripped) or a list.

    Args:
        value: ``"<a>, <b>"`` or ``["<a>", "<b>"]`` (None: no tokens).
        key: the config key, for the error message (e.g. ``model.add_tokens``).

    Raises:
        ValueError: for an empty token (e.g. a trailing comma) or a non-string item.
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    tokens = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValueError(f"{key}[{i}]: tokens are strings, got {type(item).__name__} {item!r}")
        token = item.strip() if isinstance(value, str) else item
        if not token:
            raise ValueError(f"{key}[{i}]: empty token in {value!r} (a stray comma?); list non-empty tokens")
        tokens.append(token)
    return tokens


def load_special_token_descriptions(source: str | Mapping[str, str]) -> dict[str, str]:
    """Read `new_special_tokens_config`: a YAML/JSON file (or a mapping) of token -> description.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: when it is not a non-empty mapping of non-empty strings to strings (names the
            file and the offending token).
    """
    where = "model.new_special_tokens_config"
    if isinstance(source, Mapping):
        data: object = dict(source)
    else:
        import yaml

        file = resolve_path(source)
        if not file.is_file():
            raise FileNotFoundError(
                f"{where}: {source!r} (resolved to {file}) is not a file; give a YAML or JSON file "
                "mapping each new special token to its description"
            )
        where = str(file)
        try:
            data = yaml.safe_load(file.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"{where}: not valid YAML/JSON ({err})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"{where}: must map each new special token to its description, e.g. "
            f"{{'<think>': 'start of the reasoning'}}; got {type(data).__name__} {data!r}"
        )
    out: dict[str, str] = {}
    for token, text in data.items():
        if not isinstance(token, str) or not token:
            raise ValueError(f"{where}: the token {token!r} must be a non-empty string")
        if not isinstance(text, str):
            raise ValueError(f"{where}: {token}: the description must be a string, got {text!r}")
        out[token] = text
    return out


def extend_tokenizer(
    tokenizer: PreTrainedTokenizerBase,
    *,
    add_tokens: str | Sequence[str] | None = None,
    add_special_tokens: str | Sequence[str] | None = None,
    new_special_tokens_config: str | Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> TokenizerExtension:
    """Add ordinary then special tokens to ``tokenizer`` in place (LLaMA-Factory's order and rules).

    `new_special_tokens_config`, when given, supplies the special tokens (its keys, in file
    order) and their descriptions; `add_special_tokens` is then ignored with a warning. The
    result is also stored on the tokenizer (read it back with `tokenizer_extension`).

    Returns:
        The `TokenizerExtension`: requested tokens, the new ids, the descriptions.
    """
    emit = log or (lambda _msg: None)
    tokens = parse_token_list(add_tokens, key="model.add_tokens")
    descriptions: dict[str, str] = {}
    if new_special_tokens_config is not None:
        descriptions = load_special_token_descriptions(new_special_tokens_config)
        if add_special_tokens is not None:
            emit(
                "warning: model.new_special_tokens_config is set, so model.add_special_tokens is ignored; "
                f"special tokens from the file: {', '.join(descriptions)}"
            )
        special = list(descriptions)
    else:
        special = parse_token_list(add_special_tokens, key="model.add_special_tokens")
    size_before = len(tokenizer)
    if tokens:
        tokenizer.add_tokens(tokens, special_tokens=False)
    if special:
        tokenizer.add_tokens(special, special_tokens=True)
    vocab = tokenizer.get_vocab()
    new_ids = {t: int(vocab[t]) for t in [*tokens, *special] if t in vocab and int(vocab[t]) >= size_before}
    extension = TokenizerExtension(
        tokens=tuple(tokens),
        special_tokens=tuple(special),
        new_ids=new_ids,
        descriptions=descriptions,
        size_before=size_before,
    )
    setattr(tokenizer, _EXTENSION_ATTR, extension)
    if extension.requested:
        kept = len(tokens) + len(special) - len(new_ids)
        already = f" ({kept} already in the vocabulary)" if kept else ""
        emit(
            f"tokenizer: added {len(new_ids)} tokens{already}: {len(tokens)} ordinary, {len(special)} special; "
            f"{size_before} -> {len(tokenizer)} tokens"
        )
    return extension


def tokenizer_extension(tokenizer: PreTrainedTokenizerBase) -> TokenizerExtension:
    """What `extend_tokenizer` added to ``tokenizer`` (an empty extension when nothing was)."""
    found = getattr(tokenizer, _EXTENSION_ATTR, None)
    if isinstance(found, TokenizerExtension):
        return found
    return TokenizerExtension(size_before=len(tokenizer))


def eod_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
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
