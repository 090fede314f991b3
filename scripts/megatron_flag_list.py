"""Write `src/meshforge/config/megatron_flags.py`: every flag of Megatron-LM's argument parser and
of the projects built on it, with how many values each takes.

Megatron-LM builds most of its parser from dataclasses (`ArgumentGroupFactory`), so the flags are
read from the parser itself: `add_megatron_arguments` is called on a fresh `ArgumentParser` with
the optional GPU packages it imports replaced by empty stand-ins (nothing of them runs while the
parser is built). MindSpeed-LLM and MindSpeed register their flags with literal `add_argument`
calls, read here with `ast`; of MindSpeed's own flags, those MindSpeed-LLM's example scripts use.

    python scripts/megatron_flag_list.py --megatron SRC --mindspeed-llm SRC --mindspeed SRC \
        --megatron-commit SHA --mindspeed-llm-commit SHA --mindspeed-commit SHA

Each SRC is a checkout (or `git archive`) of the project. Run with the repo's venv (torch needed).
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import re
import sys
import textwrap
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "meshforge" / "config" / "megatron_flags.py"
# Optional packages Megatron-LM imports at module level; the parser needs none of them.
STUBBED = (
    "nvidia_resiliency_ext",
    "triton",
    "transformer_engine",
    "apex",
    "flash_attn",
    "modelopt",
    "tensorstore",
    "zarr",
    "wandb",
    "one_logger",
    "multistorageclient",
    "opentelemetry",
    "nvtx",
    "mamba_ssm",
    "causal_conv1d",
    "flashinfer",
    "deep_ep",
    "grouped_gemm",
)


class _StubType(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def __getitem__(cls, item: object) -> type:
        return cls


def _stub_class(name: str) -> type:
    return _StubType(
        name,
        (),
        {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: a[0] if a else self},
    )


class _StubModule(types.ModuleType):
    __version__ = "99.0.0"

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, name: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _takes(action: argparse.Action) -> str:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return "0"
    if action.nargs is None:
        return "1"
    return str(action.nargs)


def megatron_flags(src: Path) -> dict[str, list[str]]:
    """{argparse group title: ['--flag:TAKES', ...]} of Megatron-LM's parser."""
    import typing

    import torch  # noqa: F401 - imported before the stand-ins, which torch must not see
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined] - Megatron needs 3.12's
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(src))
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    groups: dict[str, list[str]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            takes = _takes(action)
            for flag in action.option_strings:
                if flag.startswith("--"):
                    groups.setdefault(group.title or "options", []).append(f"{flag}:{takes}")
    return groups


def _ast_flags(root: Path) -> dict[str, str]:
    """{flag: TAKES} of the literal `add_argument('--flag', ...)` calls under `root`."""
    found: dict[str, str] = {}
    for file in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            keywords = {k.arg: k.value for k in node.keywords}
            action = keywords.get("action")
            nargs = keywords.get("nargs")
            if isinstance(action, ast.Constant) and action.value in (
                "store_true",
                "store_false",
                "store_const",
            ):
                takes = "0"
            elif action is not None and "BooleanOptional" in ast.unparse(action):
                takes = "0"
            elif isinstance(nargs, ast.Constant):
                takes = str(nargs.value)
            else:
                takes = "1"
            for name in names:
                if name.startswith("--"):
                    found.setdefault(name, takes)
    return found


def _used_in_examples(root: Path) -> set[str]:
    used: set[str] = set()
    for file in root.rglob("*.sh"):
        used.update(
            re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", file.read_text(encoding="utf-8", errors="ignore"))
        )
    return used


def _block(name: str, groups: dict[str, list[str]]) -> str:
    lines = [f"{name}: dict[str, str] = {{"]
    for title, flags in groups.items():
        text = " ".join(flags)
        wrapped = textwrap.wrap(text, 96, break_on_hyphens=False, break_long_words=False)
        lines.append(f"    {title!r}: (")
        lines += [f"        {chunk + ' '!r}" for chunk in wrapped[:-1]]
        lines.append(f"        {wrapped[-1]!r}")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("megatron", "mindspeed-llm", "mindspeed"):
        parser.add_argument(f"--{name}", type=Path, required=True)
        parser.add_argument(f"--{name}-commit", required=True)
    args = parser.parse_args()
    megatron = megatron_flags(args.megatron)
    known = {flag.split(":")[0] for flags in megatron.values() for flag in flags}
    llm = {f: t for f, t in _ast_flags(args.mindspeed_llm / "mindspeed_llm").items() if f not in known}
    known |= set(llm)
    used = _used_in_examples(args.mindspeed_llm / "examples")
    core = {f: t for f, t in _ast_flags(args.mindspeed / "mindspeed").items() if f not in known and f in used}
    derived = {
        "MindSpeed-LLM": [f"{f}:{t}" for f, t in sorted(llm.items())],
        "MindSpeed": [f"{f}:{t}" for f, t in sorted(core.items())],
    }
    header = f'''"""Every flag of Megatron-LM's `pretrain_gpt.py` parser and of the projects built on it (generated).

Written by `scripts/megatron_flag_list.py` from Megatron-LM {args.megatron_commit}
(`megatron/training/arguments.py`, the parser `add_megatron_arguments` builds), MindSpeed-LLM
{args.mindspeed_llm_commit} (its `add_argument` calls) and MindSpeed {args.mindspeed_commit} (those of its
flags that MindSpeed-LLM's example scripts use). Do not edit by hand: run the script again.

Each group maps to `--flag:TAKES` words: TAKES is how many values the flag takes (0: a switch,
1: one value, `+`: one or more, `*`: any number, a number: exactly that many). What meshforge does
with each flag is `config/megatron_table.py`'s.
"""

from __future__ import annotations

MEGATRON_SOURCE = "Megatron-LM {args.megatron_commit}"
DERIVED_SOURCE = "MindSpeed-LLM {args.mindspeed_llm_commit}, MindSpeed {args.mindspeed_commit}"

'''
    body = _block("MEGATRON", megatron) + "\n\n" + _block("DERIVED", derived) + "\n"
    tail = """

def _parse(groups: dict[str, str], origin: str) -> dict[str, tuple[str, str, str]]:
    out: dict[str, tuple[str, str, str]] = {}
    for group, words in groups.items():
        for word in words.split():
            flag, takes = word.rsplit(":", 1)
            out.setdefault(flag, (takes, group, origin))
    return out


# flag -> (TAKES, group title, origin: "Megatron-LM" or the derived project's name)
FLAGS: dict[str, tuple[str, str, str]] = {
    **_parse(MEGATRON, "Megatron-LM"),
    **{flag: (t, g, g) for flag, (t, g, _o) in _parse(DERIVED, "").items()},
}
"""
    OUT.write_text(header + body + tail, encoding="utf-8")
    print(
        f"wrote {OUT}: {sum(len(v) for v in megatron.values())} Megatron-LM flags, {len(llm)} MindSpeed-LLM, {len(core)} MindSpeed"
    )


if __name__ == "__main__":
    main()
