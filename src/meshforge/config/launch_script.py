"""Read a shell launch script without running it: its variables expanded, its training line found.

Megatron-style scripts keep their flags in variables (`GPT_ARGS="--num-layers 28 \\ ..."`, bash
arrays `MODEL_ARGS=(--num-layers 32 ...)`) and end with `torchrun $DISTRIBUTED_ARGS pretrain_gpt.py
$GPT_ARGS ...`. This module reads such a script as bash would read it, without executing anything:
line continuations, comments, single and double quotes (multi-line strings included), `X=...`,
`export X=...`, `X+=...`, arrays and `"${X[@]}"`, `$X`, `${X}`, `${X:-default}` / `${X-default}`,
`$((A*B))`, word splitting of unquoted expansions, and `if` / `elif` / `else` blocks whose test is
a plain comparison (`[[ "$A" == "b" ]]`, `[ -n "$X" ]`). Positional parameters (`$1`) are empty, as
for a script started without arguments, so `${1:-default}` gives the default. Command
substitution (`$(...)`) is never run: a value that needs it stays unknown, and the training line
may not use one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshforge.config.base import ConfigError

ENTRY_POINTS = ("pretrain_gpt.py", "pretrain_mamba.py", "posttrain_gpt.py", "pretrain_llama.py", "train.py")
LAUNCHERS = ("torchrun", "python", "python3", "deepspeed", "srun")


class _Unknown(str):
    """A value that needs a command substitution (never run)."""


@dataclass
class Word:
    """One shell word as pieces: (text, quoted) pairs, before expansion."""

    parts: list[tuple[str, str]] = field(default_factory=list)  # (text, "'" | '"' | "")


@dataclass
class Command:
    line: int
    words: list[Word]
    text: str


def _split_commands(text: str) -> list[Command]:
    """Commands with their first line; quotes, escapes, comments and `;`/`|`/`&&` handled."""
    commands: list[Command] = []
    words: list[Word] = []
    word: Word | None = None
    quote = ""
    i, line, start = 0, 1, 1
    raw_start = 0
    depth = 0  # inside `NAME=( ... )`: newlines separate words

    def flush_word() -> None:
        nonlocal word
        if word is not None:
            words.append(word)
            word = None

    def flush_command(end: int) -> None:
        nonlocal words, start, raw_start
        flush_word()
        if words:
            commands.append(Command(start, words, text[raw_start:end].strip()))
        words = []

    while i < len(text):
        ch = text[i]
        if quote == "'":
            if ch == "'":
                quote = ""
            else:
                assert word is not None
                word.parts.append((ch, "'"))
            line += ch == "\n"
            i += 1
            continue
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            i += 2
            if nxt == "\n":
                line += 1
                continue
            if word is None:
                word = Word()
            word.parts.append((nxt if quote or nxt != "\n" else "", "'"))
            continue
        if quote == '"':
            if ch == '"':
                quote = ""
            else:
                assert word is not None
                word.parts.append((ch, '"'))
            line += ch == "\n"
            i += 1
            continue
        if ch in "'\"":
            quote = ch
            if word is None:
                word = Word()
            word.parts.append(("", ch))
            i += 1
            continue
        if ch == "#" and word is None:
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        if ch == "$" and text.startswith("$((", i):
            end = text.find("))", i)
            end = len(text) if end < 0 else end + 2
            if word is None:
                word = Word()
            word.parts.append((text[i:end], ""))
            i = end
            continue
        if ch == "$" and text.startswith("$(", i):
            depth, j = 0, i + 1
            while j < len(text):
                depth += text[j] == "("
                depth -= text[j] == ")"
                j += 1
                if depth == 0:
                    break
            if word is None:
                word = Word()
            word.parts.append((text[i:j], ""))
            i = j
            continue
        if ch in " \t" or (ch == "\n" and depth > 0):
            flush_word()
            line += ch == "\n"
            i += 1
            continue
        if ch in "()":
            depth = max(0, depth + (1 if ch == "(" else -1))
        if ch in "|&" and text.startswith(ch * 2, i):
            flush_word()
            words.append(Word([(ch * 2, "")]))
            i += 2
            continue
        if ch in "\n;|&":
            flush_command(i)
            while i < len(text) and text[i] in ";|&":
                i += 1
            if i < len(text) and text[i] == "\n":
                line += 1
                i += 1
            start, raw_start = line, i
            continue
        if text.startswith("${", i):
            end = text.find("}", i)
            end = len(text) if end < 0 else end + 1
            if word is None:
                word = Word()
            word.parts.append((text[i:end], ""))
            line += text.count("\n", i, end)
            i = end
            continue
        if word is None:
            word = Word()
        word.parts.append((ch, ""))
        i += 1
    flush_command(len(text))
    return commands


_VAR = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*|[0-9#@*?$!-]))")


class Shell:
    """Variables and arrays of the script read so far."""

    def __init__(self) -> None:
        self.vars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}

    def lookup(self, expr: str) -> list[str] | str:
        """A `${...}` body: name, `name[@]`, `name:-default`, `name-default`, `#name`."""
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)\[[@*]\]", expr)
        if match:
            return self.arrays.get(match.group(1), [])
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(:?[-=])(.*)", expr, re.S)
        if match:
            name, op, default = match.groups()
            value = self.value(name)
            empty = value is None or (op.startswith(":") and value == "")
            return self.expand_text(default.replace('"', "").replace("'", "")) if empty else str(value)
        value = self.value(expr)
        return "" if value is None else value

    def value(self, name: str) -> str | None:
        if name in self.arrays:
            return self.arrays[name][0] if self.arrays[name] else ""
        if name in self.vars:
            return self.vars[name]
        if name == "PWD":
            return os.getcwd()
        return None if name.isdigit() else os.environ.get(name)

    def arith(self, expr: str) -> str:
        body = self.expand_text(expr[3:-2])
        body = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.vars.get(m.group(0), "0") or "0", body)
        if not re.fullmatch(r"[0-9+\-*/%() ]*", body):
            return _Unknown(expr)
        try:
            return str(int(eval(body.replace("/", "//"), {"__builtins__": {}})))  # noqa: S307 - digits and operators only
        except (SyntaxError, ZeroDivisionError):
            return _Unknown(expr)

    def expand_text(self, text: str) -> str:
        """`text` with its expansions, as one string (inside double quotes)."""
        return "".join(" ".join(v) if isinstance(v, list) else v for v, _ in self._pieces(text))

    def _pieces(self, text: str) -> list[tuple[str | list[str], bool]]:
        """(value, is an expansion) pieces of `text`: literal characters and expanded values."""
        pieces: list[tuple[str | list[str], bool]] = []
        i = 0
        while i < len(text):
            if text.startswith("$((", i):
                end = text.find("))", i) + 2
                pieces.append((self.arith(text[i:end]), True))
                i = end
                continue
            if text.startswith("$(", i):
                pieces.append((_Unknown(text[i:]), True))
                break
            match = _VAR.match(text, i)
            if match:
                body = match.group("braced") if match.group("braced") is not None else match.group("plain")
                pieces.append((self.lookup(body), True))
                i = match.end()
                continue
            pieces.append((text[i], False))
            i += 1
        return pieces

    def expand(self, word: Word) -> list[str]:
        """A word after expansion and word splitting (only unquoted expansions split)."""
        groups: list[tuple[str, str]] = []
        for text, quote in word.parts:
            if groups and groups[-1][1] == quote:
                groups[-1] = (groups[-1][0] + text, quote)
            else:
                groups.append((text, quote))
        chars: list[tuple[str, bool]] = []  # (character, splittable); BREAK ends a field
        quoted = any(quote for _, quote in word.parts)
        unknown = False
        for text, quote in groups:
            if quote == "'":
                chars += [(c, False) for c in text]
                continue
            for value, expanded in self._pieces(text):
                unknown = unknown or isinstance(value, _Unknown)
                if isinstance(value, list):
                    if quote == '"':
                        for k, item in enumerate(value):
                            if k:
                                chars.append((_BREAK, False))
                            chars += [(c, False) for c in item]
                        continue
                    value = " ".join(value)
                chars += [(c, expanded and not quote) for c in value]
        fields: list[str] = []
        current: list[str] = []
        keep = quoted
        for c, splittable in chars:
            if c == _BREAK or (splittable and c in " \t\n"):
                if current or (c == _BREAK):
                    fields.append("".join(current))
                current = []
                keep = False
                continue
            current.append(c)
        if current or keep:
            fields.append("".join(current))
        return [_Unknown(f) if unknown else f for f in fields]


_BREAK = "\0"
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)


@dataclass
class TrainingLine:
    """The line that runs the training entry point: its flags and what launched it."""

    line: int
    launcher: list[str]
    entry: str
    flags: list[str]


def _entry_index(words: list[str]) -> tuple[int, str] | None:
    for k, word in enumerate(words):
        if Path(word).name in ENTRY_POINTS or re.search(r"(pre|post)train_\w+\.py$", word):
            return k + 1, word
        if word == "meshforge" and k >= 1 and words[k - 1] == "-m" and words[k + 1 : k + 2] == ["megatron"]:
            return k + 2, "-m meshforge megatron"
    return None


def _condition(shell: Shell, words: list[str]) -> bool | None:
    """A `[[ ... ]]` / `[ ... ]` test of comparisons joined by || and &&; None when not readable."""
    words = [w for w in words if w not in ("[[", "]]", "[", "]", "then")]
    result: bool | None = None
    joiner = "&&"
    while words:
        if words[0] in ("||", "&&"):
            joiner = words.pop(0)
            continue
        if len(words) >= 3 and words[1] in ("==", "=", "!="):
            a, op, b = words[:3]
            value = (a == b) if op != "!=" else (a != b)
            words = words[3:]
        elif len(words) >= 2 and words[0] in ("-n", "-z"):
            value = (words[1] != "") if words[0] == "-n" else (words[1] == "")
            words = words[2:]
        elif len(words) >= 2 and words[0] == "!" and words[1] in ("-n", "-z") and len(words) >= 3:
            value = (words[2] == "") if words[1] == "-n" else (words[2] != "")
            words = words[3:]
        else:
            return None
        result = value if result is None else (result or value) if joiner == "||" else (result and value)
    return result


def read_script(path: str, say: Callable[[str], None] | None = None) -> TrainingLine:
    """The training line of the launch script at `path`, its variables expanded.

    Raises:
        ConfigError: the file cannot be read, or no line runs a training entry point (the lines
            looked at are named).
    """
    tell = say or (lambda _line: None)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([(path, f"cannot read the launch script: {err}")]) from None
    shell = Shell()
    active: list[bool] = []
    taken: list[bool] = []
    looked: list[str] = []
    for command in _split_commands(text):
        head = shell.expand(command.words[0]) if command.words else []
        name = head[0] if head else ""
        if name in ("if", "elif"):
            cond = _condition(shell, [f for w in command.words[1:] for f in (shell.expand(w) or [""])])
            if cond is None:
                tell(f"{path}:{command.line}: cannot evaluate {command.text!r}: its block is skipped")
            if name == "if":
                active.append(bool(cond))
                taken.append(bool(cond))
            else:
                active[-1] = bool(cond) and not taken[-1]
                taken[-1] = taken[-1] or bool(cond)
            continue
        if name == "else" and active:
            active[-1] = not taken[-1]
            continue
        if name == "fi" and active:
            active.pop()
            taken.pop()
            continue
        if name in ("then", "do", "done"):
            continue
        if not all(active):
            continue
        words = command.words[1:] if name in ("export", "declare", "local", "readonly") else command.words
        assigned = _assign(shell, words)
        if assigned:
            continue
        expanded = [f for w in command.words for f in shell.expand(w)]
        found = _entry_index(expanded)
        if found is None:
            if any(
                Path(w).name in ("torchrun", "python", "python3", "deepspeed", "srun") for w in expanded[:3]
            ):
                looked.append(f"line {command.line}: {' '.join(expanded)[:120]}")
            continue
        start, entry = found
        flags = expanded[start:]
        unknown = [w for w in flags if isinstance(w, _Unknown) or "$(" in w]
        if unknown:
            raise ConfigError(
                [
                    (
                        f"{path}:{command.line}",
                        f"the training line needs a command substitution, which is never run: {unknown[0]}",
                    )
                ]
            )
        return TrainingLine(
            command.line, expanded[: start - (3 if entry.startswith("-m") else 1)], entry, flags
        )
    where = "; ".join(looked) if looked else "no torchrun or python line"
    raise ConfigError(
        [
            (
                path,
                f"no line runs a training entry point ({', '.join(ENTRY_POINTS)} or -m meshforge megatron); "
                f"looked at: {where}",
            )
        ]
    )


def _assign(shell: Shell, words: list[Word]) -> bool:
    """Apply `NAME=value` / `NAME+=value` / `NAME=( ... )` words; False when the command is not one."""
    if not words:
        return False
    first = words[0]
    prefix = ""
    for text, quote in first.parts:
        if quote:
            break
        prefix += text
    match = _ASSIGN.match(prefix)
    if not match:
        return False
    name, plus, _rest = match.groups()
    # the value: the first word's parts after `=`, then any `( ... )` array words
    cut = len(name) + len(plus) + 1
    consumed, value_parts = 0, []
    for text, quote in first.parts:
        if consumed >= cut or quote:
            value_parts.append((text, quote))
        else:
            take = cut - consumed
            consumed += len(text)
            if len(text) > take:
                value_parts.append((text[take:], quote))
    if value_parts and value_parts[0] == ("(", ""):
        items: list[str] = []
        rest = [Word(value_parts[1:])] if len(value_parts) > 1 else []
        for word in rest + words[1:]:
            body = Word([(t, q) for t, q in word.parts if not (q == "" and t == ")")])
            items += [f for f in shell.expand(body) if f or body.parts]
        items = [i for i in items if i != ""]
        shell.arrays[name] = (shell.arrays.get(name, []) if plus else []) + items
        shell.vars.pop(name, None)
        return True
    if len(words) > 1:
        return False  # `X=1 command ...`: an environment prefix, not an assignment
    value = " ".join(shell.expand(Word(value_parts))) if value_parts else ""
    shell.vars[name] = (shell.vars.get(name, "") if plus else "") + value
    return True


def is_launch_script(path: str | os.PathLike[str]) -> bool:
    """A shell script by its name (`.sh`, `.bash`) or its first line (`#!... sh`)."""
    file = Path(path)
    if file.suffix in (".sh", ".bash"):
        return True
    try:
        with file.open("rb") as handle:
            first = handle.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"sh" in first
