"""Prompts for `meshforge generate`: `--prompt` texts and `--prompts` JSON lines, chat-templated when asked.

A JSON line is ``{"prompt": "text"}`` (plain text, or a chat turn with ``--chat``) or
``{"messages": [{"role": ..., "content": ...}, ...]}`` (a conversation: always rendered with the
tokenizer's chat template and a generation prompt). Errors name the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    """One prompt as the user gave it (text or messages) and where it came from (for error messages)."""

    source: str
    text: str | None = None
    messages: tuple[Message, ...] | None = None

    def as_record(self) -> str | list[Message]:
        """The prompt as written to the output (`"prompt"` field)."""
        return self.text if self.text is not None else list(self.messages or ())


def _messages(value: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for turn in value:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("role"), str)
            or not isinstance(turn.get("content"), str)
        ):
            raise ValueError(f"{where}: every message needs a string 'role' and 'content', got {turn!r}")
    return tuple({"role": t["role"], "content": t["content"]} for t in value)


def read_prompts(texts: list[str], file: str | None) -> list[Prompt]:
    """The prompts of ``--prompt`` (in order) then of ``--prompts FILE.jsonl``.

    Raises:
        FileNotFoundError: For a missing file (named with its option).
        ValueError: For a line that is not a JSON object with ``prompt`` or ``messages``.
    """
    prompts = [Prompt(source=f"--prompt #{i + 1}", text=t) for i, t in enumerate(texts)]
    if file is None:
        return prompts
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts: {file}: no such file (JSON lines with 'prompt' or 'messages')")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if isinstance(row, dict) and "messages" in row:
            prompts.append(Prompt(source=where, messages=_messages(row["messages"], where)))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(Prompt(source=where, text=row["prompt"]))
        else:
            raise ValueError(f"{where}: expected an object with a string 'prompt' or a 'messages' list")
    return prompts


def encode_prompt(prompt: Prompt, tokenizer: PreTrainedTokenizerBase, *, chat: bool) -> list[int]:
    """Token ids of ``prompt``: through the chat template for messages (or any text with ``chat``).

    Raises:
        ValueError: When a chat template is needed and the tokenizer has none.
    """
    messages = prompt.messages
    if messages is None and chat:
        messages = ({"role": "user", "content": prompt.text or ""},)
    if messages is None:
        return list(tokenizer(prompt.text or "")["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{prompt.source}: a conversation needs the tokenizer's chat template and "
            f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')}) has none; "
            "give plain 'prompt' text without --chat"
        )
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
