"""Megatron-LM's recompute flags in a MindSpeed file, for `config/importer.py` (light).

Megatron names them `--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`;
in a YAML file they are written by their argument names (`recompute_granularity`, ...).
"""

from __future__ import annotations

from collections.abc import Callable

from meshforge.config.base import Issue

Flat = dict[str, object]
To = Callable[[str, object, str], None]  # (native path, value, MindSpeed key)
Say = Callable[[str], None]


def megatron_recompute(flat: Flat, to: To, say: Say, issues: list[Issue]) -> None:
    """Megatron-LM's recompute flags, with Megatron's rules and meaning.

    ``full`` recomputes whole layers: ``block`` the first ``recompute_num_layers`` layers of the
    (only) pipeline stage, ``uniform`` every layer (Megatron checkpoints groups of that many
    layers as one region; here each layer is its own region, which recomputes the same and
    keeps each layer's input). ``selective`` recomputes the core attention: the attention
    modules are recomputed with the projections' matmul outputs kept (``exclude_op``), so the
    attention kernel runs again and q/k/v/o are not.
    """
    granularity, method = flat.get("recompute_granularity"), flat.get("recompute_method")
    layers = flat.get("recompute_num_layers")
    if flat.get("recompute") is True:
        issues.append(("recompute", "give recompute or recompute_granularity (Megatron's flag), not both"))
        return
    if granularity not in ("full", "selective"):
        issues.append(("recompute_granularity", f"must be 'full' or 'selective', got {granularity!r}"))
        return
    if granularity == "selective":
        if method is not None or layers is not None:
            # Megatron: "recompute method is not yet supported for selective recomputing granularity".
            issues.append(("recompute_method", "only with recompute_granularity 'full' (as in Megatron)"))
            return
        to("recompute.mode", "full", "recompute_granularity")
        to("recompute.modules", ["model.layers.{*}.self_attn"], "recompute_granularity")
        to("recompute.exclude_op", ["matmul"], "recompute_granularity")
        return
    if method not in ("uniform", "block"):
        issues.append(
            ("recompute_method", f"recompute_granularity 'full' needs 'uniform' or 'block', got {method!r}")
        )
        return
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        issues.append(
            ("recompute_num_layers", f"recompute_granularity 'full' needs a positive integer, got {layers!r}")
        )
        return
    to("recompute.mode", "full", "recompute_granularity")
    if method == "block":
        to(
            "recompute.full_recompute_layer",
            [f"0-{layers - 1}" if layers > 1 else "0"],
            "recompute_num_layers",
        )
    else:
        to("recompute.modules", ["model.layers.{*}"], "recompute_method")
        if layers > 1:
            say(
                f"recompute_num_layers -> each layer is its own recomputed region (Megatron: groups of {layers}); "
                "the same layers are recomputed, and each layer's input is kept"
            )
