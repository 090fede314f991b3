"""Convert alpaca / sharegpt / openai records to LLaMA-Factory's `_prompt/_response/_system/_tools`.

Each converter works on one record and returns the aligned example plus `_error`: "" when the
example is usable, else the reason it is dropped, so the loader can report counts by reason at the
end of preprocessing (LLaMA-Factory only logs a warning per record). The rules are LLaMA-Factory's
(LLaMA-Factory's `data/converter.py`): alpaca history pairs become user/assistant turns and instruction + input are joined with
a newline; sharegpt takes a leading system message as `_system`, roles must alternate
(user/observation at even positions, assistant/function at odd ones), the count must be even; the
processor filter (odd `len(_prompt)`, exactly one response) is applied here too. Empty turns are
also counted as broken, so that an empty answer is never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

USER, ASSISTANT, SYSTEM, FUNCTION, OBSERVATION = "user", "assistant", "system", "function", "observation"


def _aligned(
    prompt: list[dict[str, str]],
    response: list[dict[str, str]],
    system: object,
    tools: object,
    error: str,
    ranking: bool = False,
) -> dict[str, object]:
    answers = 2 if ranking else 1  # a ranking example answers with (chosen, rejected)
    if error:
        prompt, response = [], []
    elif not (len(prompt) % 2 == 1 and len(response) == answers):
        error = (
            "not one prompt ending in a user turn and a chosen and a rejected answer"
            if ranking
            else "not one prompt ending in a user turn and one response"
        )
        prompt, response = [], []
    tools_text = tools if tools is None or isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)
    return {
        "_prompt": prompt,
        "_response": response,
        "_system": system if isinstance(system, str) else "",
        "_tools": tools_text or "",
        "_error": error,
    }


def convert_alpaca(
    example: dict[str, Any], columns: dict[str, str | None], ranking: bool = False
) -> dict[str, object]:
    """One alpaca record -> aligned example (see the module docstring).

    A ranking record answers with its `chosen` and `rejected` columns (both strings), in that order.
    """
    prompt: list[dict[str, str]] = []
    error = ""
    history = example.get(columns["history"]) if columns["history"] else None
    if isinstance(history, list):
        for pair in history:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                error = "history entry is not a [prompt, response] pair"
                break
            prompt.append({"role": USER, "content": str(pair[0])})
            prompt.append({"role": ASSISTANT, "content": str(pair[1])})
    query = []
    if columns["prompt"] and example.get(columns["prompt"]):
        query.append(example[columns["prompt"]])
    if columns["query"] and example.get(columns["query"]):
        query.append(example[columns["query"]])
    prompt.append({"role": USER, "content": "\n".join(query)})
    if ranking:
        pair = [example.get(name) if (name := columns[key]) else None for key in ("chosen", "rejected")]
        texts = [value for value in pair if isinstance(value, str)]
        response = [{"role": ASSISTANT, "content": text} for text in texts] if len(texts) == 2 else []
        if not error and len(texts) != 2:
            error = "missing chosen or rejected answer"
        elif not error and "" in texts:
            error = "empty turn"
    else:
        value = example.get(columns["response"]) if columns["response"] else None
        response = [{"role": ASSISTANT, "content": value}] if isinstance(value, str) else []
        if not error and value is None:
            error = "missing response"
    if not error and not query:
        error = "empty turn"
    system = example.get(columns["system"]) if columns["system"] else ""
    tools = example.get(columns["tools"]) if columns["tools"] else ""
    return _aligned(prompt, response, system, tools, error, ranking)


def convert_sharegpt(
    example: dict[str, Any],
    columns: dict[str, str | None],
    tags: dict[str, str | None],
    ranking: bool = False,
) -> dict[str, object]:
    """One sharegpt (or openai messages) record -> aligned example (see the module docstring)."""
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    roles = {
        tags["user_tag"]: USER,
        tags["assistant_tag"]: ASSISTANT,
        tags["observation_tag"]: OBSERVATION,
        tags["function_tag"]: FUNCTION,
        tags["system_tag"]: SYSTEM,
    }
    accept = ((tags["user_tag"], tags["observation_tag"]), (tags["assistant_tag"], tags["function_tag"]))
    messages = example.get(columns["messages"]) if columns["messages"] else None
    if not isinstance(messages, list):
        return _aligned([], [], "", "", "missing messages")
    system_tag = tags["system_tag"]
    if system_tag and messages and isinstance(messages[0], dict) and messages[0].get(role_tag) == system_tag:
        system = messages[0].get(content_tag)
        messages = messages[1:]
    else:
        system = example.get(columns["system"]) if columns["system"] else ""
    aligned, error = [], ""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get(role_tag) not in accept[i % 2]:
            error = "roles not alternating"
            break
        content = _content(message, content_tag)
        if content is None or content == "":
            error = "empty turn"
            break
        aligned.append({"role": roles[message[role_tag]], "content": content})
    if not error and ((not ranking and len(aligned) % 2 != 0) or (ranking and len(aligned) % 2 == 0)):
        error = "odd number of messages"
    tools = example.get(columns["tools"]) if columns["tools"] else ""
    if ranking:
        answers, pair_error = _ranked_answers(example, columns, tags, roles)
        return _aligned(aligned, answers, system, tools, error or pair_error, ranking)
    return _aligned(aligned[:-1], aligned[-1:], system, tools, error)


def _ranked_answers(
    example: dict[str, Any],
    columns: dict[str, str | None],
    tags: dict[str, str | None],
    roles: dict[str | None, str],
) -> tuple[list[dict[str, str]], str]:
    """The chosen and rejected messages of a sharegpt ranking record (assistant or function turns)."""
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    answers = []
    for key in ("chosen", "rejected"):
        name = columns[key]
        message = example.get(name) if name else None
        if not isinstance(message, dict):
            return [], "missing chosen or rejected answer"
        if message.get(role_tag) not in (tags["assistant_tag"], tags["function_tag"]):
            return [], "chosen or rejected is not an assistant turn"
        content = _content(message, content_tag)
        if content is None or content == "":
            return [], "empty turn"
        answers.append({"role": roles[message[role_tag]], "content": content})
    return answers, ""


def _content(message: Mapping[str, object], content_tag: str | None) -> str | None:
    content = message.get(content_tag) if content_tag else None
    return content if isinstance(content, str) or content is None else json.dumps(content, ensure_ascii=False)


def convert_openai(
    example: dict[str, Any], columns: dict[str, str | None], tags: dict[str, str | None]
) -> dict[str, object]:
    """One OpenAI `messages` record, as LLaMA-Factory's OpenAI converter reads it.

    Differences from sharegpt: an assistant message with `tool_calls` becomes a function turn whose
    content is the JSON list of the calls' `function` objects, and consecutive tool messages are
    merged into one observation turn (joined by `</tool_response>\n<tool_response>`).
    """
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    roles = {
        tags["user_tag"]: USER,
        tags["assistant_tag"]: ASSISTANT,
        tags["observation_tag"]: OBSERVATION,
        tags["function_tag"]: FUNCTION,
        tags["system_tag"]: SYSTEM,
    }
    messages = example.get(columns["messages"]) if columns["messages"] else None
    if not isinstance(messages, list):
        return _aligned([], [], "", "", "missing messages")
    system_tag = tags["system_tag"]
    if system_tag and messages and isinstance(messages[0], dict) and messages[0].get(role_tag) == system_tag:
        system = messages[0].get(content_tag)
        messages = messages[1:]
    else:
        system = example.get(columns["system"]) if columns["system"] else ""
    aligned: list[dict[str, str]] = []
    pending: list[str] = []
    error = ""
    for message in messages:
        if not isinstance(message, dict) or message.get(role_tag) not in roles:
            error = "roles not alternating"
            break
        role, content = message[role_tag], _content(message, content_tag)
        if role in (tags["assistant_tag"], tags["function_tag"]) and message.get("tool_calls"):
            content = json.dumps([call["function"] for call in message["tool_calls"]], ensure_ascii=False)
            role = tags["function_tag"]
        if role == tags["observation_tag"]:
            pending.append(content or "")
            continue
        if pending:
            aligned.append(
                {"role": OBSERVATION, "content": "\n</tool_response>\n<tool_response>\n".join(pending)}
            )
            pending = []
        if content is None or content == "":
            error = "empty turn"
            break
        aligned.append({"role": roles[role], "content": content})
    accept = ((USER, OBSERVATION), (ASSISTANT, FUNCTION))
    if not error and any(m["role"] not in accept[i % 2] for i, m in enumerate(aligned)):
        error = "roles not alternating"
    if not error and len(aligned) % 2 != 0:
        error = "odd number of messages"
    tools = example.get(columns["tools"]) if columns["tools"] else ""
    return _aligned(aligned[:-1], aligned[-1:], system, tools, error)


def convert_batch(
    batch: dict[str, list],
    *,
    formatting: str,
    columns: dict[str, str | None],
    tags: dict[str, str | None],
    ranking: bool,
) -> dict[str, list]:
    """`datasets.map(batched=True)` entry point: convert every record of a column batch."""
    size = len(next(iter(batch.values()))) if batch else 0
    out: dict[str, list] = {"_prompt": [], "_response": [], "_system": [], "_tools": [], "_error": []}
    for i in range(size):
        example = {key: values[i] for key, values in batch.items()}
        if formatting == "alpaca":
            row = convert_alpaca(example, columns, ranking)
        elif formatting == "openai":
            row = convert_openai(example, columns, tags)
        else:
            row = convert_sharegpt(example, columns, tags, ranking)
        for key in out:
            out[key].append(row[key])
    return out


def check_columns(column_names: list[str], formatting: str, columns: dict, where: str) -> None:
    """Raise ValueError when a configured column the converter needs is absent from the data."""
    needed: tuple[str, ...] = ("prompt", "query", "response", "history", "system", "tools")
    if formatting != "alpaca":
        needed = ("messages", "system", "tools")
    missing = [
        f"{key}={columns[key]!r}" for key in needed if columns.get(key) and columns[key] not in column_names
    ]
    required = {"alpaca": ("response",), "sharegpt": ("messages",), "openai": ("messages",)}[formatting]
    hard = [m for m in missing if m.split("=")[0] in required]
    if hard:
        raise ValueError(
            f"{where}: missing column(s) {', '.join(hard)} (the data has: {', '.join(column_names)}); "
            "set them under `columns` (a given columns object replaces all defaults)"
        )
