"""Which modules a recompute/swap key names: decoder layers by global index, submodules by path.

The reference configs name submodules with MindFormers' words (``attention``, ``mlp``,
``attention.qkv``); transformers (and every built-in family here) calls them ``self_attn``,
``linear_attn``, ``mlp``, ``self_attn.q_proj``. A key is a regex ``fullmatch``ed against the
module paths inside one decoder layer. When it matches nothing as written, each of its dotted
parts that is a reference word is replaced by the alternatives in ``ALIASES`` and the key is
tried again, so both vocabularies work on every family without a per-family table; last, a
key may name the end of a path (``experts`` is ``mlp.experts``). A key that
still matches nothing is an error naming the config key (the reference only logs a warning,
and a typo then silently trains without the memory saving).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn

from meshforge.config.layer_spec import LayerRange

#: Reference (MindFormers / Megatron) module words -> the regex of transformers-style names they mean.
ALIASES: dict[str, str] = {
    "attention": "(?:self_attn|linear_attn|attention|self_attention|attn)",
    "self_attention": "(?:self_attn|linear_attn|attention|self_attention|attn)",
    "mlp": "(?:mlp|feed_forward|block_sparse_moe)",
    "feed_forward": "(?:mlp|feed_forward|block_sparse_moe)",
    "experts": "experts",
    # The projections that read the attention input: dense q/k/v, MLA's first projections,
    # Gated DeltaNet's input projections.
    "qkv": "(?:q_proj|k_proj|v_proj|qkv_proj|q_a_proj|kv_a_proj_with_mqa|in_proj_qkvz|in_proj_ba)",
    "linear_qkv": "(?:q_proj|k_proj|v_proj|qkv_proj|q_a_proj|kv_a_proj_with_mqa|in_proj_qkvz|in_proj_ba)",
    "w1": "(?:gate_proj|w1)",
    "w3": "(?:up_proj|w3)",
    "w2": "(?:down_proj|w2)",
    "linear_fc1": "(?:gate_proj|up_proj)",
    "linear_fc2": "down_proj",
    "linear_proj": "o_proj",
}


def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(global layer index, layer)`` for each decoder layer this rank holds.

    A pipeline stage keeps its layers in a ModuleDict keyed by their global index, so layer
    specs mean the same layers whatever the split.

    Raises:
        ValueError: The model has no ``model.layers``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return [(int(key), layer) for key, layer in layers.items()]
    if isinstance(layers, nn.ModuleList):
        return list(enumerate(layers))
    raise ValueError(
        f"{type(model).__name__} has no model.layers (a ModuleList of decoder layers): "
        "recompute and swap select layers by their index there"
    )


def layer_indices(specs: Sequence[LayerRange] | None) -> set[int]:
    """The union of the layers a list of layer specs names."""
    return {i for spec in specs or () for i in spec.layers()}


def _compile(pattern: str, key: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{key}: {pattern!r} is not a valid regular expression ({err})") from err


def _aliased(pattern: str) -> str | None:
    parts = pattern.split(".")
    swapped = [ALIASES.get(part, re.escape(part) if part.isidentifier() else part) for part in parts]
    if all(part not in ALIASES for part in parts):
        return None
    return r"\.".join(swapped)


def match_submodules(layer: nn.Module, pattern: str, *, key: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of the submodules of ``layer`` whose path ``fullmatch``es ``pattern``.

    The pattern is tried as written, then with reference words replaced by ``ALIASES``, then
    both as the end of a dotted path (``experts`` finds ``mlp.experts``); the first that
    matches wins. Returns an empty list when none matches (the caller names what was looked for).

    Raises:
        ValueError: ``pattern`` is not a valid regex (``key`` names the config key).
    """
    named = [(path, module) for path, module in layer.named_modules() if path]
    tries = [pattern]
    aliased = _aliased(pattern)
    if aliased is not None:
        tries.append(aliased)
    # Last, as the end of a path: `experts` names `mlp.experts`, `qkv` the q/k/v projections.
    tries += [rf"(?:.+\.)?(?:{t})" for t in list(tries)]
    for attempt in tries:
        regex = _compile(attempt, key)
        found = [(p, m) for p, m in named if regex.fullmatch(p)]
        if found:
            return found
    return []


def no_match_error(key: str, pattern: str, layer: nn.Module, where: Iterable[int]) -> ValueError:
    """The error for a module key that names nothing in the layers it was asked for."""
    children = sorted(name for name, _ in layer.named_children())
    layers = ", ".join(str(i) for i in sorted(where))
    return ValueError(
        f"{key}: {pattern!r} matches no submodule of decoder layer(s) {layers} "
        f"({type(layer).__name__} has {', '.join(children)}; reference words "
        f"{', '.join(sorted(ALIASES))} are mapped to these names, see docs/memory.md)"
    )
