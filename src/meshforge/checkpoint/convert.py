"""Offline conversion between meshforge DCP step folders and Hugging Face folders (`meshforge convert`).

`dcp_to_hf` rebuilds the model a run trained (from the run's resolved `config.yaml`), loads a DCP
step folder into it and writes a HF folder (config.json, sharded safetensors with an index,
tokenizer files). `hf_to_dcp` goes the other way and writes a step folder (DCP shards,
`trainer_state.json` without optimizer state, the `COMPLETE` marker) that `checkpoint.load_path`
with `checkpoint.no_load_optim: true` loads. One process is enough: each runs in a one-rank
process group, so DCP takes the same code path as in training.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from meshforge.checkpoint.hf import CONFIG_FILE, hf_adapter, load_hf_weights, read_hf_config, save_hf
from meshforge.checkpoint.manager import COMPLETE_MARKER, TRAINER_STATE_FILE, resolve_load_path
from meshforge.checkpoint.readers import read_dcp_metadata
from meshforge.checkpoint.source import resolve_model_source
from meshforge.models.materialize import to_empty_keeping_ties

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.checkpoint.source import ModelSource
    from meshforge.config.root import TrainConfig
    from meshforge.models.config import ModelConfig
    from meshforge.models.registry import FamilySpec

Log = Callable[[str], None]


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A one-process gloo group for the duration (none is created when one exists)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build_on_cpu(family: FamilySpec, options: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = family.build(options)
    model.to(dtype=dtype)
    # Storage only: every parameter is overwritten by the load that follows. Tied weights stay
    # tied (transformers models do not re-tie after to_empty), or a tied export would carry an
    # lm_head.weight key of its own.
    return to_empty_keeping_ties(model, "cpu")


def dcp_to_hf(
    step_dir: str | Path,
    out_dir: str | Path,
    *,
    config_path: str | Path | None = None,
    shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    log: Log = print,
) -> Path:
    """Export a DCP step folder of a meshforge run as a Hugging Face folder.

    Args:
        step_dir: A complete step folder, or a run / checkpoints folder (its latest complete step).
        out_dir: Destination HF folder.
        config_path: The run's resolved config; default ``step_dir/../../config.yaml`` (the run
            folder's copy when checkpoints live in ``{output_dir}/checkpoints``).
        shard_size: Largest safetensors shard (``"5GB"``, bytes, ...).
        dtype: Cast weights to this dtype (default: the run's ``model.params_dtype``).
        log: Progress sink.

    Raises:
        FileNotFoundError: When the step folder or the config is missing (names the path and the
            ``--config`` option).
    """
    from meshforge.config import load_config
    from meshforge.utils.dtype import parse_dtype

    try:
        step = resolve_load_path(step_dir)
    except FileNotFoundError as err:
        # The resolver speaks of the config key; here the folder came from the command line.
        raise FileNotFoundError(str(err).replace("checkpoint.load_path: ", "convert: ", 1)) from None
    read_dcp_metadata(step)
    cfg_file = Path(config_path) if config_path else step.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file}: the run's config.yaml was not found; pass it with --config "
            "(it describes the model the checkpoint holds)"
        )
    cfg = load_config(str(cfg_file), [])
    source = resolve_model_source(cfg.model, log=log)
    params_dtype = parse_dtype(cfg.model.params_dtype, key="model.params_dtype")
    tokenizer = _maybe_tokenizer(cfg.model, log)
    options = grown_options(cfg.model, source, tokenizer, log)
    if cfg.lora_config is not None:
        return _lora_step_to_hf(cfg, source, options, step, Path(out_dir), tokenizer, params_dtype, log)
    with _one_rank_group():
        model = _build_on_cpu(source.family, options, params_dtype)
        state = {"model": get_model_state_dict(model)}
        # Read by this process alone: a training run exports from rank 0 while the others wait.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(step), no_dist=True)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        out = save_hf(
            model,
            source.family,
            out_dir,
            tokenizer=tokenizer,
            shard_size=shard_size,
            dtype=dtype,
            collective=False,
        )
    log(f"convert: wrote {out} (Hugging Face {source.family.name}) from {step}")
    return out


def _lora_step_to_hf(
    cfg: TrainConfig,
    source: ModelSource,
    options: dict[str, Any],
    step: Path,
    out: Path,
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: torch.dtype,
    log: Log,
) -> Path:
    """A LoRA run's step: the merged HF folder in `out` and the PEFT adapter in `out/adapter`."""
    from meshforge.checkpoint.manager import read_trainer_state
    from meshforge.lora.offline import build_adapted, load_lora_step, lora_record
    from meshforge.lora.peft_io import save_merged_hf, save_peft_adapter
    from meshforge.lora.settings import lora_settings

    assert cfg.lora_config is not None
    record = lora_record(read_trainer_state(step))
    if record is None:
        raise ValueError(
            f"convert: {step} holds a full model but its config has lora_config; remove it from --config"
        )
    settings = lora_settings(cfg.lora_config)
    cpu = torch.device("cpu")
    with _one_rank_group():
        model = build_adapted(source.family, options, settings, dtype=dtype, device=cpu)
        load_lora_step(
            model, source.family, step, record, settings=settings, seed=cfg.training.seed, device=cpu, log=log
        )
        base = record.get("base", {})
        base_name = str(base.get("path", "")) if isinstance(base, dict) else ""
        save_peft_adapter(model, source.family, out / "adapter", settings=settings, base_model=base_name)
        save_merged_hf(model, source.family, out, tokenizer=tokenizer, collective=False)
    log(
        f"convert: wrote {out} (Hugging Face {source.family.name}, adapters merged) and the PEFT adapter {out / 'adapter'} from {step}"
    )
    return out


def grown_options(
    model_cfg: ModelConfig, source: ModelSource, tokenizer: PreTrainedTokenizerBase | None, log: Log
) -> dict[str, Any]:
    """The model options with the vocabulary the run trained: tokens added by the config grow it."""
    if tokenizer is None:
        return dict(source.options)
    from meshforge.data.tokenizer import tokenizer_extension
    from meshforge.models.vocab import vocab_plan

    size = source.family.parse_options(source.options).vocab_size
    plan = vocab_plan(
        tokenizer, size, resize_vocab=model_cfg.resize_vocab, added=tokenizer_extension(tokenizer), log=log
    )
    return plan.model_options(dict(source.options))


def _maybe_tokenizer(model_cfg: ModelConfig, log: Log) -> PreTrainedTokenizerBase | None:
    from meshforge.data.tokenizer import build_tokenizer, extension_options

    name = model_cfg.tokenizer_name_or_path or model_cfg.model_name_or_path
    if not name:
        log("convert: warning: the config names no tokenizer; no tokenizer files written")
        return None
    try:
        # The run's added tokens (model.add_tokens, ...) belong to the checkpoint's vocabulary.
        return build_tokenizer(name, use_fast=model_cfg.use_fast_tokenizer, **extension_options(model_cfg))
    except (OSError, ValueError) as err:
        log(f"convert: warning: tokenizer {name!r} not loaded ({err}); no tokenizer files written")
        return None


def hf_to_dcp(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32, log: Log = print
) -> Path:
    """Write a HF folder's weights as a meshforge DCP step folder (weights only).

    The folder gets ``trainer_state.json`` (step 0, no optimizer state), the ``COMPLETE`` marker
    and ``model.yaml``, a ``model:`` section describing the model (to paste into a config that
    loads it with ``checkpoint.load_path`` and ``checkpoint.no_load_optim: true``).

    Args:
        hf_dir: The HF folder (config.json and safetensors).
        out_dir: A new (or empty) folder for the step.
        dtype: Dtype of the stored weights: the training master weights (``model.params_dtype``).
        log: Progress sink.

    Raises:
        FileNotFoundError: When ``hf_dir`` lacks config.json or weights.
        FileExistsError: When ``out_dir`` is not empty.
        ValueError: When its family is not built.
    """
    from meshforge.models.registry import resolve_family

    src = Path(hf_dir).expanduser().resolve()
    config = read_hf_config(src)
    try:
        family = resolve_family(config.get("model_type"), config.get("architectures"), None)
    except ValueError as err:
        raise ValueError(f"{src / CONFIG_FILE}: {err}") from None
    options = hf_adapter(family).from_hf_config(config)
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose a new folder")
    with _one_rank_group():
        model = _build_on_cpu(family, options, dtype)
        load_hf_weights(model, family, src, log=log)
        out.mkdir(parents=True, exist_ok=True)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out))
    state = {"step": 0, "tokens_seen": 0, "has_optimizer": False, "converted_from": str(src)}
    (out / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    section = {
        "model": {"model_type": family.name, "params_dtype": str(dtype).removeprefix("torch."), **options}
    }
    (out / "model.yaml").write_text(yaml.safe_dump(section, sort_keys=False))
    (out / COMPLETE_MARKER).write_text("0\n")
    log(
        f"convert: wrote DCP step folder {out} from {src}; load it with checkpoint.load_path: {out} and "
        f"checkpoint.no_load_optim: true, with the model: section in {out / 'model.yaml'}"
    )
    return out
