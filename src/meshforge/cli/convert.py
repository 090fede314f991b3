"""`meshforge convert`: DCP step folders <-> Hugging Face folders, offline.

`--to hf` is `train.export.dcp_to_hf` (the model a run trained, rebuilt from its resolved
`config.yaml`); `--to dcp` is `hf_to_dcp` here: a HF folder's weights as a step folder (DCP
shards, `trainer_state.json` without optimizer state, the `COMPLETE` marker) that
`checkpoint.load_path` with `checkpoint.no_load_optim: true` loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from meshforge.checkpoint.hf import CONFIG_FILE, hf_adapter, load_hf_weights, read_hf_config
from meshforge.checkpoint.manager import COMPLETE_MARKER, TRAINER_STATE_FILE
from meshforge.checkpoint.offline import build_on_cpu, one_rank_group

Log = Callable[[str], None]


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
    with one_rank_group():
        model = build_on_cpu(family, options, dtype)
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


def run_convert(args: argparse.Namespace) -> int:
    from meshforge.config import ConfigError

    try:
        from meshforge.train.export import dcp_to_hf
        from meshforge.utils.dtype import parse_dtype

        if args.to == "hf":
            dtype = parse_dtype(args.dtype, key="--dtype") if args.dtype else None
            dcp_to_hf(args.source, args.out, config_path=args.config, shard_size=args.shard_size, dtype=dtype)
        else:
            if args.config or args.dtype:
                raise ValueError("--config and --dtype apply to --to hf only")
            hf_to_dcp(args.source, args.out)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
