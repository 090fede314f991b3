"""What a meshforge command leaves on stderr: meshforge's own lines and real warnings only.

Libraries meshforge imports print lines a user can neither act on nor read in a log file. Each
rule below names the library and the message it drops; everything else passes:

- torchao, on import, loads its prebuilt C++ extensions and logs `Failed to load
  .../torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library: ...` on the
  `torchao` logger for each one this interpreter or torch build cannot load (the wheel's
  extensions are built for CPython 3.10 and CUDA), or `Skipping import of cpp extensions ...`
  when torch is older than it expects. The extensions are optional kernels; torchao works
  without them. transformers imports torchao whenever it is installed (its quantizer registry,
  reached on every Hugging Face model load), so `meshforge generate` printed these on every run.
- The same import registers torchao's enums (`KernelPreference`, `ScaleCalculationMode`) as
  pytree constants, which torch logs on `torch.utils._pytree` as deprecated (`<enum ...> is an
  Enum subclass and is now natively supported by torch.compile ...`), once per enum and rank.
  Only torchao's enums are dropped: the same message about any other enum still shows.
- tqdm progress bars of datasets (`Generating train split`, `map` / `filter` during SFT data
  preparation), transformers (`Loading weights`, `Writing model shards`) and huggingface_hub
  (downloads) redraw their line with `\\r`; in a log file every redraw is kept. They are switched
  off only when stderr is not a terminal, through the environment variable each library reads
  (`HF_DATASETS_DISABLE_PROGRESS_BARS`, `HF_HUB_DISABLE_PROGRESS_BARS`, which transformers
  follows), set only where the user has not set it: `=0` keeps the bars in a log file. A library
  imported before the policy reads its variable no more, so its switch function is called too.
  meshforge's own training bar (`monitor/console.py`) already shows on a terminal only.

These are records of the `logging` module, not `warnings`: Python's warning filters are left
alone, so every warning still shows. Dropping happens through a filter on the emitting logger,
which keeps the logger's level and handlers (torch's log settings) as they are.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable, MutableMapping
from typing import TextIO

_TORCHAO_EXTENSION = re.compile(r"Failed to load \S+\.so: |Skipping import of cpp extensions\b")
_ENUM_CONSTANT = "is an Enum subclass and is now natively supported by torch.compile"

#: (environment variable, module, switch function): a bar switch of a library meshforge imports.
_PROGRESS_SWITCHES = (
    ("HF_HUB_DISABLE_PROGRESS_BARS", "huggingface_hub.utils", "disable_progress_bars"),
    ("HF_HUB_DISABLE_PROGRESS_BARS", "transformers.utils.logging", "disable_progress_bar"),
    ("HF_DATASETS_DISABLE_PROGRESS_BARS", "datasets", "disable_progress_bars"),
)


def _torchao_extension_message(record: logging.LogRecord) -> bool:
    return _TORCHAO_EXTENSION.match(record.getMessage()) is not None


def _torchao_enum_constant(record: logging.LogRecord) -> bool:
    """torch's deprecation of `register_constant` on an Enum, for an enum torchao defines."""
    if _ENUM_CONSTANT not in str(record.msg) or not isinstance(record.args, tuple) or not record.args:
        return False
    module = getattr(record.args[0], "__module__", None)
    return isinstance(module, str) and (module == "torchao" or module.startswith("torchao."))


#: logger name -> the records of it that are dropped.
_DROPPED: dict[str, Callable[[logging.LogRecord], bool]] = {
    "torchao": _torchao_extension_message,
    "torch.utils._pytree": _torchao_enum_constant,
}


class _DropKnownNoise(logging.Filter):
    """Drops the records of one logger that `match` recognises; passes every other record."""

    def __init__(self, match: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.match(record)


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (a closed or fake stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def quiet_library_output(
    stream: TextIO | None = None, environ: MutableMapping[str, str] | None = None
) -> None:
    """Install the stderr policy of this module; calling it again changes nothing more.

    Args:
        stream: the stream whose being a terminal keeps the progress bars (default: `sys.stderr`
            now).
        environ: where the libraries read their progress-bar variables (default: `os.environ`,
            which processes this one starts inherit).
    """
    for name, match in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) and f.match is match for f in logger.filters):
            logger.addFilter(_DropKnownNoise(match))
    if is_terminal(sys.stderr if stream is None else stream):
        return
    env = os.environ if environ is None else environ
    chosen = {var for var, _, _ in _PROGRESS_SWITCHES if var in env}  # the user's own choice
    for var, module_name, function in _PROGRESS_SWITCHES:
        if var in chosen:
            continue
        env[var] = "1"
        module = sys.modules.get(module_name)
        if module is not None and callable(switch := getattr(module, function, None)):
            switch()
