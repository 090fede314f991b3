"""`apply_lora`: pick the target linears, attach adapters, freeze the base model.

Targets are chosen by module path, as PEFT chooses them:
- a string is a regular expression `re.fullmatch`ed against each module's dotted path
  (`'.*(q_proj|k_proj|v_proj|o_proj)'`);
- a list names modules: a path matches an entry equal to it or ending in `.<entry>`
  (`[q_proj, v_proj]`, or LLaMA-Factory's comma-separated `q_proj,v_proj`);
- `all` (LLaMA-Factory's `lora_target: all`) is every `nn.Linear` inside the decoder layers
  (`model.layers.*`): the attention and dense/shared MLP projections; never the embedding or
  the LM head. MoE routers and fused experts are not `nn.Linear` modules and stay frozen.

`exclude_layers` removes the decoder layers it names (layer specs over global layer indices, so a
pipeline stage excludes the same layers as one process). Only `nn.Linear` modules take adapters:
fused expert tensors (`[E, out, in]` parameters of an experts container) are refused by name,
as is any other non-linear module a pattern matches.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshforge.checkpoint.lora_base import is_adapter_parameter
from meshforge.lora.layer import add_adapters, init_adapter_, lora_linears

KEY = "lora_config.target_modules"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraSettings:
    """What `apply_lora` needs, independent of the config classes.

    Args:
        target_modules: a regex string, a list of module names, or `all` (see the module docstring).
        exclude_layers: global decoder-layer indices that keep no adapters.
        rank, alpha, dropout: r, alpha (scale alpha/r) and the dropout on the adapter input.
        a_std, b_std: init standard deviations of A and B (0 = zeros).
    """

    target_modules: str | tuple[str, ...]
    exclude_layers: frozenset[int] = field(default_factory=frozenset)
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    a_std: float = 0.01
    b_std: float = 0.0
    # Root modules trained whole next to the adapters, in the adapter dtype (PEFT's
    # `modules_to_save`): a reward model's value head.
    trainable_modules: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class LoraApplied:
    """The adapted module paths and the parameter counts (for the run log)."""

    targets: list[str]
    trainable: int
    frozen: int

    def summary(self) -> str:
        total = self.trainable + self.frozen
        share = self.trainable / total if total else 0.0
        return (
            f"lora: adapters on {len(self.targets)} linear layers; {self.trainable:,} trainable of "
            f"{total:,} parameters ({100 * share:.3f}%)"
        )


def _is_all(target: str | Sequence[str]) -> bool:
    return target == "all" or (not isinstance(target, str) and list(target) == ["all"])


def _layer_index(path: str) -> int | None:
    match = _LAYER.search(path + ".")
    return int(match.group(1)) if match else None


def _matcher(target: str | Sequence[str]) -> tuple[str, object]:
    if _is_all(target):
        return "all", None
    if isinstance(target, str) and "," in target and re.fullmatch(r"[\w.,\s]+", target):
        # LLaMA-Factory's `lora_target: q_proj,v_proj`: a comma-separated list of names.
        return "names", [name.strip() for name in target.split(",") if name.strip()]
    if isinstance(target, str):
        if not target.strip():
            raise ValueError(
                f"{KEY}: empty; give a regex over module paths (e.g. '.*(q_proj|v_proj)') or 'all'"
            )
        try:
            return "regex", re.compile(target)
        except re.error as err:
            raise ValueError(f"{KEY}: {target!r} is not a valid regular expression ({err})") from None
    names = [str(name) for name in target]
    if not names or any(not name.strip() for name in names):
        raise ValueError(f"{KEY}: a list of module names must be non-empty and have no blank entries")
    return "names", names


def _matches(kind: str, rule: object, path: str, module: nn.Module) -> bool:
    if kind == "all":
        return isinstance(module, nn.Linear) and _layer_index(path) is not None
    if kind == "regex":
        assert isinstance(rule, re.Pattern)
        return rule.fullmatch(path) is not None
    assert isinstance(rule, list)
    return any(path == name or path.endswith(f".{name}") for name in rule)


def _refuse(path: str, module: nn.Module) -> ValueError:
    experts = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if experts:
        return ValueError(
            f"{KEY}: {path!r} is an experts container (fused [E, out, in] weights {experts}); adapters "
            "on experts are not supported: target the attention projections or shared MLPs instead"
        )
    return ValueError(
        f"{KEY}: {path!r} is a {type(module).__name__}, not a linear layer; only nn.Linear modules take "
        "adapters (narrow the pattern, e.g. '.*(q_proj|v_proj)')"
    )


def select_targets(
    model: nn.Module, target: str | Sequence[str], exclude_layers: frozenset[int] = frozenset()
) -> list[tuple[str, nn.Linear]]:
    """The linears that get adapters, in `named_modules()` order.

    Raises:
        ValueError: naming `lora_config.target_modules` when nothing matches, the pattern is
            invalid, or a matched module is not a linear layer (experts are named as such).
    """
    kind, rule = _matcher(target)
    found: list[tuple[str, nn.Linear]] = []
    names: list[str] = []
    for path, module in model.named_modules():
        if not path or is_adapter_parameter(f"{path}.weight") or path.endswith(".lora_dropout"):
            continue
        names.append(path)
        if not _matches(kind, rule, path, module):
            continue
        if not isinstance(module, nn.Linear):
            if kind == "names" or kind == "regex":
                raise _refuse(path, module)
            continue
        layer = _layer_index(path)
        if layer is not None and layer in exclude_layers:
            continue
        found.append((path, module))
    if not found:
        examples = ", ".join(n for n in names if n.endswith("_proj"))[:200] or ", ".join(names[:6])
        excluded = " after lora_config.exclude_layers" if exclude_layers else ""
        raise ValueError(
            f"{KEY}: {target!r} matches no linear layer{excluded}; module paths are e.g. {examples}"
        )
    return found


def apply_lora(
    model: nn.Module,
    settings: LoraSettings,
    *,
    adapter_dtype: torch.dtype,
    frozen_dtype: torch.dtype | None = None,
) -> LoraApplied:
    """Attach adapters to the selected linears and freeze everything else, in place.

    Runs on the meta-device model after tensor/expert/context parallelism (the adapters read the
    base weight's TP placement) and before activation checkpointing, compile and FSDP (so each
    adapter lands in its decoder layer's FSDP unit, next to its frozen base).

    Args:
        adapter_dtype: dtype of A and B (the parameter dtype: they are trained in it).
        frozen_dtype: cast frozen parameters to this dtype (the compute dtype): they take no
            gradient and no optimizer state, so a wider master copy would only cost memory.
    """
    targets = select_targets(model, settings.target_modules, settings.exclude_layers)
    kept = {id(p) for name in settings.trainable_modules for p in model.get_submodule(name).parameters()}
    for param in model.parameters():
        if id(param) in kept:
            continue
        param.requires_grad_(False)
        if frozen_dtype is not None and param.dtype != frozen_dtype and param.is_floating_point():
            param.data = param.data.to(frozen_dtype)
    for _, linear in targets:
        add_adapters(
            linear, rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout, dtype=adapter_dtype
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return LoraApplied(targets=[name for name, _ in lora_linears(model)], trainable=trainable, frozen=frozen)


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters that train (the adapters)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def with_adapter_init(
    base_init: Callable[[str, torch.Tensor, torch.Generator], None], settings: LoraSettings
) -> Callable[[str, torch.Tensor, torch.Generator], None]:
    """An init function for `materialize_and_init`: adapters by `lora_a_std`/`lora_b_std`, the rest by `base_init`.

    With base weights loaded afterwards `base_init` is a no-op, and the adapters still get their
    init (loaded weights never cover them).
    """

    def init(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if is_adapter_parameter(name):
            init_adapter_(name, tensor, generator, a_std=settings.a_std, b_std=settings.b_std)
        else:
            base_init(name, tensor, generator)

    return init
