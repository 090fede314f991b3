"""Hugging Face checkpoint folders: read config.json, load safetensors into (sharded) models, export.

Loading never holds more than one full parameter at a time: the model is built on the meta
device, parallelised (FSDP2 DTensors or plain) and materialised first; then, parameter by
parameter, the HF tensors it needs are read lazily with ``safetensors.safe_open`` (memory-mapped,
one key at a time), converted by the family's adapter, checked, and each rank keeps its own shard.
Export is the mirror image: each parameter is gathered in full (a collective, every rank takes
part), converted to HF keys, and rank 0 appends it to the current safetensors shard file.

Each family's spec gives its adapter (``FamilySpec.hf_adapter(args)``, the
``meshforge.models.spec.HFStateDictAdapter`` protocol: ``hf_sources``, ``from_hf``, ``to_hf``,
``to_hf_config``, ``from_hf_config``, ``architecture``, ``ignored_keys``, ``renames_only``).
``meshforge.models.common.hf_adapter.HFAdapterBase`` is the identity mapping (parameter names
are the HF safetensors keys, as for qwen3); families with fused experts subclass it. The generic
path's adapter is bound to the model and the folder's keys first (``models/generic/hf.py``:
transformers' own conversion mapping), and its persistent buffers load and export too.

Families whose adapter only renames (``renames_only``) get a cheaper sharded load: each FSDP rank
reads only its own slice of a tensor from disk (``safe_open(...).get_slice``); otherwise every
rank reads the source tensors in full (one parameter at a time) and keeps its shard. Export
reads the family's args from ``model.config``.

Tied embeddings: a tied model has one parameter (``model.embed_tokens.weight``); a checkpoint may
also carry ``lm_head.weight`` (then ignored) or not.

Grown vocabulary: with a ``VocabPlan`` that resizes (``meshforge.models.vocab``), the input
embedding and an untied LM head are built with more rows than the checkpoint stores; the stored
rows load into the first rows and the new ones are left for ``init_new_rows``. Without such a
plan any shape mismatch is an error naming the file and the key.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshforge.checkpoint.readers import inside_folder, open_safetensors, read_json_object
from meshforge.models.common.dequant import quantized_view
from meshforge.models.generic.hf import bind_generic, persistent_buffers, state_tensors

if TYPE_CHECKING:
    from meshforge.models.registry import FamilySpec
    from meshforge.models.spec import HFStateDictAdapter, ModelArgs
    from meshforge.models.vocab import VocabPlan

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_TIED_HEAD = "lm_head.weight"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _few(names: list[str] | set[str], n: int = 5) -> str:
    items = sorted(names)
    more = f" (and {len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


# --------------------------------------------------------------------------------------- folders
def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``<path>/config.json``.

    Raises:
        FileNotFoundError: When the folder or its config.json is missing.
        ValueError: When config.json is not a JSON object (names the file and the JSON error).
    """
    folder = Path(path)
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder (a Hugging Face model folder with config.json)")
    if not file.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE} (a Hugging Face model folder needs one)")
    return read_json_object(file)


def is_hf_dir(path: str | Path) -> bool:
    """A folder with HF safetensors weights (single file or index) and no DCP ``COMPLETE`` marker."""
    folder = Path(path)
    has_weights = (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
    return folder.is_dir() and has_weights and not (folder / "COMPLETE").is_file()


def find_hf_weights(path: str | Path) -> dict[str, Path]:
    """Map every safetensors key of a HF folder to the file that holds it.

    Reads the index (``model.safetensors.index.json``) when present, else the single
    ``model.safetensors`` header (no tensor data).

    Raises:
        FileNotFoundError: Naming the folder, when it has neither, or naming the shard files the
            index lists that are missing.
        ValueError: Naming the file, for an index that is not JSON or has no ``weight_map``, or a
            ``model.safetensors`` whose header cannot be read (truncated).
    """
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: has no `weight_map` (key -> shard file)")
        if not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"{index}: `weight_map` values must be shard file names")
        outside = sorted(name for name in set(weight_map.values()) if not inside_folder(name))
        if outside:
            raise ValueError(
                f"{index}: names the shard file {outside[0]!r}, which is not inside {folder} "
                "(a model folder's files never point outside it)"
            )
        files = {name: folder / name for name in set(weight_map.values())}
        missing = [name for name, file in files.items() if not file.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder}: {INDEX_FILE} lists {len(files)} shard files but {len(missing)} are missing: "
                f"{_few(missing)}"
            )
        return {key: files[name] for key, name in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as handle:
            return dict.fromkeys(handle.keys(), single)
    pickled = sorted(file.name for file in folder.glob("*.bin")) + sorted(
        file.name for file in folder.glob("*.pt")
    )
    if pickled:
        raise FileNotFoundError(
            f"{folder}: its weights are pickles ({_few(pickled)}), which can carry code; meshforge reads "
            f"safetensors only ({SINGLE_FILE} or {INDEX_FILE}): convert them where you trust the files "
            "(transformers' save_pretrained writes safetensors)"
        )
    raise FileNotFoundError(
        f"{folder}: no Hugging Face weights ({SINGLE_FILE} or {INDEX_FILE}); "
        "set model.train_from_scratch: true to start from random weights"
    )


# --------------------------------------------------------------------------------------- adapter
def hf_adapter(family: FamilySpec, args: ModelArgs | None = None) -> HFStateDictAdapter:
    """The HF state-dict adapter of ``family`` (``FamilySpec.hf_adapter``), bound to ``args`` if given."""
    return family.hf_adapter(args)


# --------------------------------------------------------------------------------------- loading
def _tied_names(model: nn.Module) -> set[str]:
    """Names under which an already-listed parameter appears again (tied weights)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _where(file: Path, keys: list[str], name: str) -> str:
    """``file`` plus the HF key(s) when they differ from our parameter name (for error messages)."""
    if keys == [name]:
        return str(file)
    shown = keys[0] if len(keys) == 1 else f"{keys[0]} and {len(keys) - 1} more keys"
    return f"{file} ({shown})"


def _expected_shape(param: torch.Tensor, rows: int | None) -> tuple[int, ...]:
    """The stored shape ``param`` needs: its own, or ``rows`` rows for a grown vocabulary table."""
    shape = tuple(param.shape)
    return shape if rows is None else (rows, *shape[1:])


def _check_and_cast(
    name: str, full: torch.Tensor, param: torch.Tensor, source: str, *, rows: int | None = None
) -> torch.Tensor:
    expected = _expected_shape(param, rows)
    if tuple(full.shape) != expected:
        grown = (
            f" (the first {rows} of its {param.shape[0]} rows, the vocabulary before resizing)"
            if rows is not None
            else ""
        )
        raise ValueError(
            f"{source}: {name} has shape {tuple(full.shape)} in the checkpoint but the model "
            f"(from the model: section / config.json) needs {expected}{grown}"
        )
    if full.dtype != param.dtype:
        if not (full.dtype.is_floating_point and param.dtype.is_floating_point):
            raise ValueError(
                f"{source}: {name} is {full.dtype} in the checkpoint; the model needs {param.dtype}"
            )
        full = full.to(param.dtype)
    return full


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    family: FamilySpec,
    path: str | Path,
    *,
    log: Callable[[str], None] | None = None,
    vocab_plan: VocabPlan | None = None,
    partial: bool = False,
    aliases: dict[str, str] | None = None,
) -> int:
    """Copy a HF folder's safetensors weights into an already materialised ``model``, in place.

    Works on plain and FSDP2-sharded models: each rank reads every full parameter (lazily, one at
    a time) and keeps its local shard, with no communication.

    Args:
        model: Built, parallelised and materialised (real storage, any init).
        family: The model's family (its adapter maps names and layouts).
        path: The HF folder (``model.safetensors`` or an index with its shards).
        log: Optional sink for one summary line.
        vocab_plan: When it resizes the vocabulary, the input embedding and an untied LM head
            accept ``vocab_plan.old_vocab_size`` stored rows, loaded into their first rows (the
            new rows are left as they are, for ``meshforge.models.vocab.init_new_rows``).
        partial: ``model`` holds part of the checkpoint's model (a pipeline stage): weights of
            the other parts are not reported as unexpected.
        aliases: parameter name -> name whose stored weights it takes when its own are not in
            the checkpoint (a pipeline's last stage keeps a copy of a tied embedding as
            ``lm_head.weight``, which a tied checkpoint does not store).

    Returns:
        The number of parameters (tensors) loaded.

    Raises:
        FileNotFoundError: Missing weights or shard files (see ``find_hf_weights``).
        ValueError: Missing or unexpected keys (a few listed), or a shape that does not match
            (naming the file and the key).
    """
    from meshforge.models.vocab import vocab_parameters

    folder = Path(path)
    stored = find_hf_weights(folder)
    # A quantised release (quantization_config: fp8, mxfp4) is read through its logical keys.
    quant = quantized_view(read_hf_config(folder) if (folder / CONFIG_FILE).is_file() else {}, stored)
    key_files = quant.key_files
    adapter = hf_adapter(family, getattr(model, "config", None))
    params: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    if bind_generic(adapter, model, key_files):
        # transformers' conversions map the keys; persistent buffers the checkpoint holds load too.
        params += [
            (name, buffer)
            for name, buffer in persistent_buffers(model)
            if set(adapter.hf_sources(name)) <= set(key_files)
        ]
    sources = {name: adapter.hf_sources(name) for name, _ in params}
    # The name the adapter converts each parameter as: an aliased copy reads its source's keys.
    converted_as = {name: name for name, _ in params}
    for name, source in (aliases or {}).items():
        if name in sources and not set(sources[name]) <= set(key_files):
            sources[name] = adapter.hf_sources(source)
            converted_as[name] = source
    needed = {key for keys in sources.values() for key in keys}
    missing = needed - set(key_files)
    if missing:
        raise ValueError(
            f"{folder}: {len(missing)} weight(s) the {family.name} model needs are not in the checkpoint: "
            f"{_few(missing)}"
        )
    short_rows: dict[str, int] = {}
    if vocab_plan is not None and vocab_plan.resized:
        short_rows = dict.fromkeys(vocab_parameters(model), vocab_plan.old_vocab_size)
    tied = _tied_names(model)
    ignorable = [*adapter.ignored_keys, *tied]
    unexpected = {
        key for key in set(key_files) - needed if not any(fnmatch.fnmatchcase(key, p) for p in ignorable)
    }
    if unexpected and not partial:
        raise ValueError(
            f"{folder}: {len(unexpected)} checkpoint weight(s) have no place in the {family.name} model "
            f"described by the model: section: {_few(unexpected)}"
        )
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(key: str) -> Any:
            file = stored[key]
            if file not in handles:
                handles[file] = stack.enter_context(open_safetensors(file))
            return handles[file]

        for name, param in params:
            keys = sources[name]
            where = _where(key_files[keys[0]], keys, name)
            rows = short_rows.get(name)
            plain = not any(quant.covers(key) for key in keys)
            if isinstance(param, DTensor) and adapter.renames_only and len(keys) == 1 and plain:
                # Same layout on disk: read only this rank's rows/columns of the tensor (rows passed
                # positionally: a test wraps this function with *args).
                _copy_local_slice(name, param, handle(keys[0]).get_slice(keys[0]), where, rows)
                continue
            read = {key: quant.read(key, lambda k: handle(k).get_tensor(k)) for key in keys}
            full = adapter.from_hf(converted_as[name], read)
            full = _check_and_cast(name, full, param, where, rows=rows)
            if rows is not None:
                from meshforge.models.vocab import write_rows

                write_rows(param, 0, full)
            elif isinstance(param, DTensor):
                # Every rank holds the same full tensor: slice the local shard without communication.
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
            del full
    if log is not None:
        grown = (
            f"; {', '.join(short_rows)} loaded into the first {vocab_plan.old_vocab_size} of "
            f"{vocab_plan.new_vocab_size} rows"
            if short_rows and vocab_plan is not None
            else ""
        )
        log(f"checkpoint: loaded {len(params)} Hugging Face weights from {folder}{grown}")
    return len(params)


def _copy_local_slice(name: str, param: DTensor, stored: Any, where: str, rows: int | None = None) -> None:
    """Copy the part of a stored tensor that this rank's shard of ``param`` holds.

    With ``rows`` (a grown vocabulary table) the stored tensor has only the first ``rows`` rows;
    the local rows past them are left as they are.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(stored.get_shape())
    expected = _expected_shape(param, rows)
    if shape != expected:
        # The same message as a fully read tensor gets.
        _check_and_cast(name, torch.empty(shape, device="meta"), param, where, rows=rows)
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if local.numel() == 0:
        return
    box = [slice(start, start + size) for start, size in zip(offset, local_shape, strict=True)]
    target = local
    if rows is not None:
        stop = min(box[0].stop, rows)
        if stop <= box[0].start:
            return
        target = local[: stop - box[0].start]
        box[0] = slice(box[0].start, stop)
    part = stored[tuple(box)] if box else stored[:]
    target.copy_(_check_and_cast(name, part, target, where))


# --------------------------------------------------------------------------------------- export
def parse_size(value: int | str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2MiB"`` or a byte count -> bytes.

    Raises:
        ValueError: For a spelling that is none of these.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(value).upper())
        if not match:
            raise ValueError(f"shard_size: expected bytes or e.g. '5GB' / '500MB', got {value!r}")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])
    if size <= 0:
        raise ValueError(f"shard_size: must be positive, got {value!r}")
    return size


def _full_parameters(model: nn.Module, *, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter (and persistent buffer) in full on the CPU; a collective for DTensors."""
    tensors = state_tensors(model) if buffers else model.named_parameters()
    for name, param in tensors:
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.cpu()


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def save_hf(
    model: nn.Module,
    family: FamilySpec,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    collective: bool = True,
) -> Path:
    """Write ``model`` as a Hugging Face folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Collective: every rank must call it (sharded parameters are gathered one at a time); rank 0
    writes ``config.json``, ``model.safetensors`` (or ``model-0000x-of-0000y.safetensors`` and
    ``model.safetensors.index.json`` when the weights exceed ``shard_size``, as transformers does)
    and the tokenizer files.

    Args:
        model: A built model of ``family`` (``model.config`` holds its args).
        family: Its family spec.
        out_dir: Destination folder (created; existing weight files in it are replaced).
        tokenizer: Optional HF tokenizer saved alongside (``save_pretrained``).
        shard_size: Largest shard, bytes or a string such as ``"5GB"``.
        dtype: Cast floating weights to this dtype (default: as they are).
        collective: False when one process writes a model it holds whole (a checkpoint read
            back by rank 0 alone): no rank is waited for, and this process writes.

    Returns:
        The output folder.
    """
    from meshforge.checkpoint.safetensors_file import write_safetensors

    out = Path(out_dir)
    limit = parse_size(shard_size)
    adapter = hf_adapter(family, getattr(model, "config", None))
    generic = bind_generic(adapter, model)
    main = _is_main() or not collective
    if main:
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
            old.unlink(missing_ok=True)
    shards: list[list[str]] = []  # the keys of each written file
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    total_bytes = 0
    written: list[Path] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            # Temporary names: the number of shards is known only at the end.
            file = out / f"model-part-{len(written):05d}.safetensors"
            write_safetensors(current, file, metadata={"format": "pt"})
            written.append(file)
            shards.append(list(current))
        current, current_bytes = {}, 0

    for name, full in _full_parameters(model, buffers=generic):
        if not main:
            continue
        for key, tensor in adapter.to_hf(name, full).items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensor = tensor.contiguous()
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > limit:
                flush()
            current[key] = tensor
            current_bytes += size
            total_bytes += size
    if main:
        flush()
        _finish_files(out, written, shards, total_bytes)
        # A family's model keeps the args it was built from as `config`.
        config = adapter.to_hf_config(cast("ModelArgs", model.config))
        sample = next(iter(model.parameters()), None)
        weights_dtype = dtype or (sample.dtype if sample is not None else torch.float32)
        config.setdefault("dtype", str(weights_dtype).removeprefix("torch."))
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    import torch.distributed as dist

    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out


def _finish_files(out: Path, written: list[Path], shards: list[list[str]], total_bytes: int) -> None:
    """Give the shard files their final names and write the index (none for a single file)."""
    if len(written) == 1:
        os.replace(written[0], out / SINGLE_FILE)
        return
    weight_map: dict[str, str] = {}
    for i, (file, keys) in enumerate(zip(written, shards, strict=True), start=1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(file, out / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
