"""Which parameters get weight decay: the default rule and `optimizer.weight_decay_include/exclude`.

Rule, in order:

1. Default: a parameter with fewer than 2 dimensions (biases, RMSNorm/LayerNorm weights, scalar
   gates) gets no decay; matrices (linear weights, embeddings, lm_head) get decay. This is the
   Hugging Face convention "no decay for biases and norm weights" expressed without name lists,
   so it also holds for models whose norms are not called `norm`; embeddings keep decay, as in
   transformers' Trainer.
2. `weight_decay_include` entries force decay on the parameters they match.
3. `weight_decay_exclude` entries force no decay on the parameters they match.
4. A parameter matched by an include entry and an exclude entry is an error naming both
   (there is no silent precedence); an entry that matches no parameter is an error naming
   `optimizer.weight_decay_include[i]` with a few real parameter names.

An entry matches a parameter's full dotted name as a substring (`bias`, `norm`,
`embed_tokens`), or, when it contains `*`, `?` or `{`, as an anchored module pattern
(`meshforge.utils.patterns`): `*.bias`, `model.layers.{0-3}.*`. Wrapper segments that
torch inserts (`_orig_mod.` from `torch.compile`, `_checkpoint_wrapped_module.` from activation
checkpointing, `_fsdp_wrapped_module.`) are removed before matching, so the names are those of
the unwrapped model. FSDP2 keeps parameter names, and a DTensor's dimensions are its global
ones, so the rule is the same on one process and on a sharded mesh.

Parameters with `requires_grad=False` are left out (they are not optimized). A parameter object
listed twice (tied weights) is kept once, under its first name.

Tensor kinds: torch's fused and foreach AdamW kernels take one list of tensors per group and
refuse a list that mixes DTensors with plain tensors. A model where FSDP ignores some modules
(`parallelism.ignored_modules`) has both, so `split_by_tensor_kind` splits such a group in two
(DTensors first, then plain tensors) with the same hyperparameters; DTensors on different meshes
(dense and expert weights) may share a group, the kernels accept that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshforge.utils.patterns import ModulePattern, compile_pattern, is_pattern, suggest_names

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ParamGroups",
    "describe_param_groups",
    "normalize_param_name",
    "split_by_tensor_kind",
    "split_weight_decay",
]

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def normalize_param_name(name: str) -> str:
    """The parameter name without wrapper segments inserted by compile/checkpoint/FSDP1."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


@dataclass
class ParamGroups:
    """Parameters split by weight decay, each list in the order they were given."""

    decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)


class _Rule:
    def __init__(self, entry: str, key: str) -> None:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"{key}: expected a non-empty parameter-name rule, got {entry!r}")
        self.entry = entry
        self.key = key
        self._pattern: ModulePattern | None = None
        if is_pattern(entry):
            try:
                self._pattern = compile_pattern(entry)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        self.hits = 0

    def matches(self, name: str) -> bool:
        return self._pattern.matches(name) if self._pattern is not None else self.entry in name


def _rules(entries: Sequence[str] | None, key: str) -> list[_Rule]:
    if entries is None:
        return []
    if isinstance(entries, str):
        raise ValueError(f"{key}: expected a list of parameter-name rules, got the string {entries!r}")
    return [_Rule(e, f"{key}[{i}]") for i, e in enumerate(entries)]


def split_weight_decay(
    named_params: Iterable[tuple[str, nn.Parameter]],
    *,
    weight_decay_include: Sequence[str] | None = None,
    weight_decay_exclude: Sequence[str] | None = None,
    include_key: str = "optimizer.weight_decay_include",
    exclude_key: str = "optimizer.weight_decay_exclude",
) -> ParamGroups:
    """Split parameters into decay / no-decay groups (rules in the module docstring).

    Args:
        named_params: `(name, parameter)` pairs, e.g. `model.named_parameters()`.
        weight_decay_include: entries forcing decay.
        weight_decay_exclude: entries forcing no decay.
        include_key, exclude_key: config paths used in error messages.

    Returns:
        The two groups.

    Raises:
        ValueError: an entry is not a non-empty string or an invalid pattern, matches no
            parameter, or a parameter is matched by both an include and an exclude entry.
    """
    include = _rules(weight_decay_include, include_key)
    exclude = _rules(weight_decay_exclude, exclude_key)
    groups = ParamGroups()
    seen: set[int] = set()
    names: list[str] = []
    for raw_name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        name = normalize_param_name(raw_name)
        names.append(name)
        inc = [r for r in include if r.matches(name)]
        exc = [r for r in exclude if r.matches(name)]
        for r in inc + exc:
            r.hits += 1
        if inc and exc:
            raise ValueError(
                f"{inc[0].key}: parameter {name!r} is matched by {inc[0].entry!r} and by "
                f"{exc[0].key} ({exc[0].entry!r}); a parameter can be forced to decay or to not "
                "decay, not both: make one of the entries more specific"
            )
        if inc:
            decay = True
        elif exc:
            decay = False
        else:
            decay = param.dim() >= 2
        (groups.decay if decay else groups.no_decay).append((raw_name, param))
    for rule in include + exclude:
        if rule.hits == 0:
            examples = ", ".join(suggest_names(rule.entry, names))
            how = "pattern" if is_pattern(rule.entry) else "substring"
            raise ValueError(f"{rule.key}: {how} {rule.entry!r} matches no parameter; e.g. {examples}")
    return groups


def _count(params: list[tuple[str, nn.Parameter]]) -> tuple[int, int]:
    # numel() of a DTensor is its global size, so the summary is the same on every mesh.
    return len(params), sum(p.numel() for _, p in params)


def describe_param_groups(groups: ParamGroups, *, weight_decay: float) -> str:
    """One log line: how many tensors and elements get weight decay and how many do not."""
    nd, ed = _count(groups.decay)
    nn_, en = _count(groups.no_decay)
    return (
        f"weight decay {weight_decay:g} on {nd} tensors ({ed:,} elements); "
        f"no decay on {nn_} tensors ({en:,} elements)"
    )


def _is_dtensor(param: nn.Parameter) -> bool:
    # Imported here: this module is light (no torch import at load time).
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def split_by_tensor_kind(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Split one optimizer group's parameters so that no part mixes DTensors and plain tensors.

    Args:
        params: the parameters of one group, in order.

    Returns:
        `[params]` unchanged when they are all of one kind (or empty), else
        `[dtensors, plain_tensors]`, each in the given order.
    """
    dtensors = [p for p in params if _is_dtensor(p)]
    if not dtensors or len(dtensors) == len(params):
        return [params]
    return [dtensors, [p for p in params if not _is_dtensor(p)]]
