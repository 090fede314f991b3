"""Run every command of README.md's shell blocks, in order, as a user would in a fresh clone.

`make readme-check` runs this. The tracked files are copied into a scratch folder (a fresh
clone's tree; `.venv` is linked in), and the commands of the ```bash blocks run there in README
order as one shell session with stdin closed (an interactive command sees end of input),
so a command may use what an earlier one made and `source` works. The first failure stops the
check, naming its README line, with its output. `make` lines are the set-up this target has
already done and are listed as skipped; nothing else is skipped or rewritten.

    python scripts/readme_commands.py [--keep] [--list]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 600


@dataclass(frozen=True)
class Command:
    line: int  # README line of its first physical line
    text: str  # as written, continuation lines joined


def readme_commands(text: str) -> list[Command]:
    """Each logical command of the shell blocks (comments and blank lines dropped)."""
    found: list[Command] = []
    for block in BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending: list[str] = []
        start = first
        for offset, raw in enumerate(block.group(1).splitlines()):
            if not pending:
                start = first + offset
            if raw.rstrip().endswith("\\"):
                pending.append(raw.rstrip()[:-1])
                continue
            pending.append(raw)
            joined = " ".join(part.strip() for part in pending)
            pending = []
            words = shlex.split(joined, comments=True)
            if words:
                found.append(Command(start, joined))
    return found


def _fresh_tree(into: Path) -> None:
    """The tracked files of the repository (what `git clone` gives), and the built `.venv`."""
    listed = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (into / ".venv").symlink_to(REPO / ".venv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--list", action="store_true", help="only list the commands")
    args = parser.parse_args(argv)
    commands = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    run = [c for c in commands if shlex.split(c.text, comments=True)[0] != "make"]
    for skipped in (c for c in commands if c not in run):
        print(
            f"README.md:{skipped.line}: skipped (set-up this target has done): {skipped.text.split('#')[0].strip()}"
        )
    if args.list:
        for command in run:
            print(f"README.md:{command.line}: {command.text}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="meshforge-readme-"))
    _fresh_tree(scratch)
    env = dict(os.environ, MESHFORGE_PLOT=os.environ.get("MESHFORGE_PLOT", "1"))
    env["PATH"] = os.pathsep.join([str(REPO / ".venv" / "bin"), env.get("PATH", "")])
    env.pop("PYTHONPATH", None)  # the installed meshforge, as a user has it
    # One shell for the whole session; each command reports its status on a line of its own, and
    # a failure stops the session (the next commands may need what it should have made).
    script = ["set -u"]
    for i, command in enumerate(run):
        script.append(f"echo '@@start {i}'")
        script.append(command.text)
        # On a line of its own even after output without a newline (a prompt).
        script.append(f'rc=$?; printf "\\n@@end {i} %s\\n" "$rc"; [ "$rc" = 0 ] || exit "$rc"')
    started = time.perf_counter()
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=scratch,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S * len(run),
    )
    status = _report(run, proc.stdout)
    print(f"{len(run)} README commands, {time.perf_counter() - started:.0f} s, in {scratch}")
    if not args.keep and status == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    return status


def _report(run: list[Command], output: str) -> int:
    """Print one line per command; the whole output of the one that failed."""
    chunks = re.split(r"^@@start (\d+)\n", output, flags=re.M)
    status = 0
    for index, body in zip(chunks[1::2], chunks[2::2], strict=True):
        command = run[int(index)]
        end = re.search(r"^@@end \d+ (\d+)$", body, flags=re.M)
        code = int(end.group(1)) if end else -1
        shown = command.text if len(command.text) < 100 else command.text[:97] + "..."
        print(f"{'ok  ' if code == 0 else 'FAIL'} README.md:{command.line}: {shown}")
        if code != 0:
            print(body[: end.start()] if end else body)
            status = 1
    if len(chunks[1::2]) < len(run) and status == 0:
        print(output[-4000:])
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
