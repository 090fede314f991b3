"""DCP step folders read without unpickling code: meshforge's `StorageReader` and load planner.

A DCP step folder holds two kinds of pickles. torch's `FileSystemReader.read_metadata` reads
`.metadata` with a plain `pickle.load`, and DCP's default planner reads every non-tensor value of
a state dict (the optimizer's param-group settings) with `torch.load(weights_only=False)`; either
file, crafted, would run its code the moment a checkpoint is loaded. torch offers no safe path for
the metadata: `torch.load(weights_only=True)` reads only `torch.save`'s own formats (`.metadata`
is a bare pickle), and the restricted unpickler behind it is a private module configured through
a process-wide allowlist. So meshforge reads them itself:

- `.metadata` through `RestrictedUnpickler`, a `pickle.Unpickler` whose `find_class` answers only
  DCP's metadata classes, `torch.Size`, torch's dtypes, layouts and memory formats, the path
  classes DCP records the checkpoint id with, and plain containers; any other global is refused
  in one line naming the file and the global. The storage file names it lists must name files
  inside the step folder (no `..`, no absolute path).
- the non-tensor values through `SafeLoadPlanner.load_bytes`: `torch.load(weights_only=True)`.

Tensor data is read by torch's `FileSystemReader.read_data` itself, already with
`weights_only=True`. Every DCP load of meshforge goes through `load_dcp` (resume, a LoRA run's
base, `meshforge convert`, `meshforge generate`); `SafeFileSystemReader` refuses to read data for
any other planner, so a load that forgets the planner fails instead of reading unsafely.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from meshforge.checkpoint.readers import DCP_METADATA_FILE, inside_folder

V = TypeVar("V")  # a state dict's values (tensors, DTensors, nested optimizer state)

NO_CODE = "a checkpoint must not carry code"

_DCP = "torch.distributed.checkpoint"
# (module, name) of every global a `.metadata` written by DCP refers to.
_METADATA_GLOBALS = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        # A layout is pickled as a call of this lookup by name (torch.strided, ...).
        ("torch.serialization", "_get_layout"),
        # `StorageMeta.checkpoint_id`: the folder DCP was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist (`name` is `module.qualname`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class RestrictedUnpickler(pickle._Unpickler):
    """A pickle reader that resolves only the globals in `allowed` (`(module, name)` pairs).

    Every way a pickle reaches a callable (`GLOBAL`, `STACK_GLOBAL`, `INST`, the extension
    registry) goes through `find_class`; with no `persistent_load` a persistent id is an error.
    With `torch_constants`, torch's dtypes, layouts and memory formats resolve too. It is the
    standard library's Python implementation, whose opcodes can be overridden: `BUILD` (set an
    object's state) is allowed only on instances of the classes resolved, never on a class
    itself, which would change that class for the whole process (torch's `weights_only`
    unpickler draws the same line). Reading is as fast as the C unpickler's for DCP metadata,
    whose time goes into building its records.
    """

    stack: list[object]  # the base class's working stack, set by `load`
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, allowed: frozenset[tuple[str, str]], *, torch_constants: bool) -> None:
        super().__init__(file)
        self.allowed = allowed
        self.torch_constants = torch_constants
        self.classes: set[type] = set()

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self.allowed:
            found = super().find_class(module, name)
            if isinstance(found, type):
                self.classes.add(found)
            return found
        if (
            self.torch_constants
            and module == "torch"
            and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)
        ):
            return getattr(torch, name)
        raise RefusedGlobal(f"{module}.{name}")

    def load_build_checked(self) -> None:
        """`BUILD`: the state on top of the stack, set on the object below it, as pickle does."""
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) not in self.classes:
            what = target.__qualname__ if isinstance(target, type) else type(target).__name__
            raise RefusedGlobal(f"a state set on {what}")
        setstate = getattr(target, "__setstate__", None)
        if setstate is not None:
            setstate(state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if state:
            if not isinstance(state, dict):
                raise pickle.UnpicklingError(f"the state of a {type(target).__name__} is not a dict")
            target.__dict__.update(state)
        if slots:
            if not isinstance(slots, dict):
                raise pickle.UnpicklingError(f"the slot state of a {type(target).__name__} is not a dict")
            for key, value in slots.items():
                setattr(target, key, value)

    dispatch[pickle.BUILD[0]] = cast("Callable[[pickle.Unpickler], None]", load_build_checked)


def first_global(file: Path) -> str | None:
    """The first global a pickle file refers to, found by unpickling it with none allowed.

    None when it refers to none (or is no pickle). Nothing it names is ever resolved.
    """
    try:
        with file.open("rb") as stream:
            RestrictedUnpickler(stream, frozenset(), torch_constants=False).load()
    except RefusedGlobal as refused:
        return refused.name
    except Exception:  # noqa: BLE001 - only a refused global is of interest here
        return None
    return None


def refusal(file: Path, name: str) -> str:
    """The one line that refuses a pickled file for the global `name` it tried to load."""
    return f"{file}: refused to load {name} ({NO_CODE}); do not load this folder"


def read_metadata_file(file: Path) -> Metadata:
    """A `.metadata` file's DCP metadata, read by the restricted unpickler and checked.

    Raises:
        FileNotFoundError: when `file` does not exist.
        ValueError: naming the file: a global outside the allowlist (the global named), a file
            that cannot be unpickled (truncated, foreign), no `Metadata` inside, or a storage file
            name outside the folder.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent}: no {file.name} (not a DCP checkpoint folder)")
    try:
        with file.open("rb") as stream:
            metadata = RestrictedUnpickler(stream, _METADATA_GLOBALS, torch_constants=True).load()
    except RefusedGlobal as refused:
        raise ValueError(refusal(file, refused.name)) from None
    except Exception as err:  # noqa: BLE001 - unpickling a damaged file can raise almost anything
        raise ValueError(
            f"{file}: the DCP checkpoint metadata cannot be read ({type(err).__name__}: {err}); the "
            "checkpoint is damaged (a truncated copy?): load another step folder"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    _check_storage_names(file, metadata)
    return metadata


def read_dcp_metadata(step_dir: Path) -> Metadata:
    """The DCP metadata (global shapes and storage layout) of a checkpoint step folder.

    Raises:
        FileNotFoundError: when the folder has no `.metadata`.
        ValueError: as `read_metadata_file`.
    """
    return read_metadata_file(step_dir / DCP_METADATA_FILE)


def _check_storage_names(file: Path, metadata: Metadata) -> None:
    """Every data file the metadata names must be a relative path inside the step folder."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"{file}: `storage_data` is a {type(storage).__name__}, not a mapping")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not inside_folder(name):
            raise ValueError(
                f"{file}: names the data file {name!r}, which is not inside the checkpoint folder "
                "(a checkpoint's files never point outside it)"
            )


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor values with `weights_only=True`.

    Args:
        where: the step folder, for the messages.
    """

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            name = found.group(1) if found else "a global that is not plain data"
            raise ValueError(refusal(self.where, f"{name} for {fqn}")) from None
        except Exception as err:  # noqa: BLE001 - a damaged value can raise almost anything
            raise ValueError(
                f"{self.where}: the saved value {fqn} cannot be read ({type(err).__name__}: {err}); "
                "the checkpoint is damaged: load another step folder"
            ) from None
        # DCP's planner places the value in the state dict (nested keys, flattening); it is
        # handed the plain value written again, which `torch.save` produced here and now.
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


class SafeFileSystemReader(FileSystemReader):
    """torch's `FileSystemReader` with the metadata read by `read_metadata_file`."""

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"
        metadata = read_metadata_file(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner):
            raise TypeError(
                f"{self.path}: a DCP load through SafeFileSystemReader needs SafeLoadPlanner "
                "(DCP's default planner unpickles non-tensor values unrestricted): use load_dcp"
            )
        return super().read_data(plan, planner)


def load_dcp(state: dict[str, V], step: Path, *, no_dist: bool = False) -> None:
    """`dcp.load` of a step folder into `state` in place, through the reader and planner above.

    Raises:
        ValueError: a refused or damaged file, as the one line this module wrote (DCP gathers a
            failure of any rank into a `CheckpointException` carrying every rank's traceback).
    """
    # Read first: a refused or damaged `.metadata` is then this module's one line, not the
    # message DCP composes from the reads of the global and of a per-rank metadata file.
    read_metadata_file(step / DCP_METADATA_FILE)
    try:
        with warnings.catch_warnings():
            # `no_dist` reads in this process alone, on purpose: torch warns that it does.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(step)),
                planner=SafeLoadPlanner(step),
                no_dist=no_dist,
            )
    except CheckpointException as failed:
        ours = [exc for _, (exc, _trace) in sorted(failed.failures.items()) if isinstance(exc, ValueError)]
        if ours:
            raise ValueError(str(ours[0])) from None
        raise
