"""Optimizer state that a checkpoint and the run hold differently: tied copies and extra groups.

A pipeline's last stage keeps the tied `lm_head.weight` apart from the first stage's embedding,
and `parallelism.ignored_modules` adds param groups of its own: loading a checkpoint saved
without either needs the state renamed or the groups taken off and restored around DCP's load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def alias_tied_state(optim_sd: dict[str, Any], aliases: dict[str, str], metadata: Metadata) -> dict[str, str]:
    """Rename a tied copy's optimizer state to its source's name when only the source was saved.

    Returns the renames made (copy -> source), to undo after loading.
    """
    if not aliases:
        return {}
    saved = metadata.state_dict_metadata
    state = optim_sd.get("state", {})
    moved: dict[str, str] = {}
    for copy, source in aliases.items():
        has_copy = any(key.startswith(f"optimizer.state.{copy}.") for key in saved)
        has_source = any(key.startswith(f"optimizer.state.{source}.") for key in saved)
        if copy in state and source not in state and not has_copy and has_source:
            state[source] = state.pop(copy)
            moved[copy] = source
    return moved


def groups_not_saved(optim_sd: dict[str, Any], metadata: Metadata) -> list[dict[str, Any]]:
    """Take off (and return) the param groups this run has beyond those the checkpoint holds.

    A run with `parallelism.ignored_modules` keeps the unsharded parameters in groups of their
    own after the usual decay / no-decay groups (fused AdamW cannot mix them with DTensors);
    a checkpoint from a run without them holds fewer groups. Their settings are restored
    from a saved group by `restore_extra_groups`.
    """
    saved = metadata.state_dict_metadata
    prefix = "optimizer.param_groups."
    indices = {int(key[len(prefix) :].split(".", 1)[0]) for key in saved if key.startswith(prefix)}
    groups = optim_sd.get("param_groups", [])
    if not indices or len(groups) <= len(indices):
        return []
    optim_sd["param_groups"] = groups[: len(indices)]
    return groups[len(indices) :]


def restore_extra_groups(optim_sd: dict[str, Any], extra: list[dict[str, Any]]) -> None:
    """Give each group the checkpoint did not hold the loaded settings of the group with its weight decay."""
    if not extra:
        return
    loaded = optim_sd["param_groups"]
    for group in extra:
        like = next((g for g in loaded if g.get("weight_decay") == group.get("weight_decay")), loaded[0])
        group.update({key: value for key, value in like.items() if key != "params"})
    optim_sd["param_groups"] = loaded + extra
