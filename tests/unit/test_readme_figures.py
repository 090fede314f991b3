"""The memory figures the documentation quotes are what `meshforge config validate` prints now.

README.md's table of real-size examples gives each example's predicted peak per rank; each
example's opening comment quotes its plan (state + activations + buffers = peak, with and
without recompute); docs/*.md show whole `config validate` outputs in ```text blocks that open
with the command. Each is planned here, in this process, by the command the example or the block names,
and compared with the printed figures, digit for digit.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex

import pytest

from meshforge.utils.hardware import hardware
from tests.conftest import REPO

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
NO_RECOMPUTE = ("--recompute.mode=None", "--recompute.full_recompute_layer=null")
DEVICE_BYTES = hardware("h100").memory_gib * 2**30  # an 80 GB device's usable bytes
_ROW = re.compile(r"^\| \[`(configs/examples/[\w.]+\.yaml)`\]\([^)]*\) \|.*\| ([0-9.]+) GiB \|$", re.M)
_PEAK = re.compile(
    r"predicted peak per rank \([^)]*\): "
    r"(state [0-9.]+ GiB \+ activations [0-9.]+ GiB \+ buffers [0-9.]+ GiB = ([0-9.]+) GiB)"
)
_BLOCK = re.compile(r"^```text\n(\$ meshforge config validate .*?)^```$", re.M | re.S)


def _table() -> list[tuple[str, str]]:
    """``(config path, peak per rank)`` of each row of README's table of real-size examples."""
    return _ROW.findall(README.read_text(encoding="utf-8"))


def _head(config: str) -> str:
    """The example's opening comment as one line of text (``#`` and line breaks dropped)."""
    head = (REPO / config).read_text(encoding="utf-8").split("\n\n", 1)[0]
    lines = [line.removeprefix("#").strip() for line in head.splitlines()]
    return " ".join(" ".join(lines).replace("\\ ", " ").split())


def _documented_args(config: str) -> tuple[str, ...]:
    """The `config validate` arguments the example's comment gives (its published config.json)."""
    found = re.search(
        rf"meshforge config validate ({re.escape(config)} .*?--model\.model_name_or_path=\S+)", _head(config)
    )
    assert found is not None, f"{config}: its comment gives no `meshforge config validate` command"
    return tuple(shlex.split(found.group(1)))


@functools.cache
def _validate(args: tuple[str, ...]) -> str:
    """What `meshforge config validate ARGS` prints, run from the repository root."""
    from meshforge.cli.main import main

    out = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out):
        status = main(["config", "validate", *args])
    assert status == 0, out.getvalue()
    return out.getvalue()


def _peak(out: str) -> re.Match[str]:
    found = _PEAK.search(out)
    assert found is not None, out
    return found


def test_readme_has_the_table_of_real_size_examples() -> None:
    configs = [config for config, _ in _table()]
    assert len(configs) >= 4 and len(set(configs)) == len(configs), configs
    assert all((REPO / config).is_file() for config in configs), configs


@pytest.mark.slow  # builds each published model on the meta device and traces a micro-batch
@pytest.mark.parametrize("config, figure", _table(), ids=[c.rsplit("/", 1)[1] for c, _ in _table()])
def test_readme_peak_per_rank_is_the_printed_one(config: str, figure: str) -> None:
    assert figure == _peak(_validate(_documented_args(config))).group(2)


@pytest.mark.slow  # plans each example twice: as written and without recompute
@pytest.mark.parametrize("config", [c for c, _ in _table()], ids=lambda c: c.rsplit("/", 1)[1])
def test_example_comment_quotes_its_plan(config: str) -> None:
    head = _head(config)
    args = _documented_args(config)
    printed = _peak(_validate(args)).group(1)
    assert f"Predicted per rank (`config validate`): {printed}" in head, (printed, head)
    without = _peak(_validate((*args, *NO_RECOMPUTE)))
    flags = " ".join(NO_RECOMPUTE)
    assert f"Without recompute (`{flags}`): {without.group(1)}" in head, (without.group(1), head)
    if "does not fit 80 GB" in head:
        assert float(without.group(2)) * 2**30 > DEVICE_BYTES, without.group(0)


def _blocks() -> list[tuple[str, str]]:
    """``(file name, block)`` of every ```text block that opens with `$ meshforge config validate`."""
    found = []
    for path in DOCS:
        for block in _BLOCK.findall(path.read_text(encoding="utf-8")):
            found.append((path.name, block))
    return found


def _line_pattern(line: str) -> re.Pattern[str]:
    """A shown output line as a pattern: ``...`` stands for what the documentation leaves out."""
    return re.compile(".*".join(re.escape(part) for part in line.strip().split("...")))


def test_docs_show_validate_outputs() -> None:
    assert {name for name, _ in _blocks()} >= {"memory.md", "parallelism.md"}


@pytest.mark.slow  # plans a 1024-rank layout of a published model
@pytest.mark.parametrize("name, block", _blocks(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(_blocks())])
def test_docs_validate_output_is_the_printed_one(name: str, block: str) -> None:
    command, *shown = block.replace("\\\n", " ").splitlines()
    args = shlex.split(command)
    assert args[:4] == ["$", "meshforge", "config", "validate"], command
    printed = [line.strip() for line in _validate(tuple(args[4:])).splitlines()]
    # The shown lines appear in the output, in its order (a block may show only some of them).
    rest = iter(printed)
    for line in shown:
        pattern = _line_pattern(line)
        assert any(pattern.fullmatch(out) for out in rest), f"{name}: {line!r} is not printed:\n" + "\n".join(
            printed
        )
