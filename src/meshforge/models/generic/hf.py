"""Hugging Face checkpoints of the generic path, converted by transformers' own weight-conversion mapping.

transformers 5.x keeps some modules in a different layout in memory than in the checkpoint it
writes: a Mixtral-style MoE holds its experts fused (``mlp.experts.gate_up_proj``, one
``[experts, 2 * ffn, hidden]`` tensor) while ``save_pretrained`` writes one key per expert and
projection (``block_sparse_moe.experts.{i}.w1.weight``). Which keys become which parameter, and
how, is transformers' per-model conversion mapping (``conversion_mapping.get_model_conversion_mapping``:
``WeightRenaming`` and ``WeightConverter`` transforms). The generic path uses that mapping rather
than a key list of its own, so any model ``from_pretrained`` loads from a folder loads here.

Loading mirrors ``core_model_loading.convert_and_load_state_dict_in_model``: each checkpoint key is
renamed with ``rename_source_key`` (every renaming, then at most one converter); the keys that name
the same parameter form one group, whose transform (a fresh copy) converts the group's tensors.
The difference is the order: meshforge's loader walks the model's parameters, one at a time, so a
group's tensors are read when its parameter is loaded (``GenericHFAdapter.hf_sources`` /
``from_hf``) and every rank keeps its own shard.

Export is transformers' ``revert_weight_conversion`` applied to one group of parameters at a time
(the parameters one reversed converter reads together), so the folder holds the keys
``save_pretrained`` writes and ``from_pretrained`` reloads it. A loaded model keeps the transforms
its checkpoint used (``_weight_conversions``, as ``from_pretrained`` leaves it), so a model loaded
from a renamed checkpoint is written back under the same names.

Persistent buffers (MiniMax-M2's router ``e_score_correction_bias``) are part of the state dict
transformers saves and loads; ``state_tensors`` lists them with the parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshforge.models.common.hf_adapter import HFAdapterBase

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.core_model_loading import WeightConverter, WeightRenaming, WeightTransform

    from meshforge.models.common.hf_adapter import AdapterFamily
    from meshforge.models.spec import ModelArgs


def state_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then persistent buffers, under their state-dict names (tied aliases once)."""
    yield from model.named_parameters()
    yield from persistent_buffers(model)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds (and ``save_pretrained`` writes), by state-dict name."""
    for module_name, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in skip:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _conversions(model: nn.Module, *, saving: bool) -> list[WeightTransform]:
    """The transforms ``from_pretrained`` (or, reversed, ``save_pretrained``) applies to ``model``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    hf_model = cast("PreTrainedModel", model)
    if not saving:
        return list(get_model_conversion_mapping(hf_model))
    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        return list(used)
    # As revert_weight_conversion does for a model not built by from_pretrained.
    return [
        t for t in get_model_conversion_mapping(hf_model, add_legacy=False) if not isinstance(t, PrefixChange)
    ]


@dataclass
class _Group:
    """The checkpoint keys one transform turns into one or more state tensors."""

    transform: WeightConverter | WeightRenaming
    first: str  # the state name transformers converts the group under
    sources: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, matched pattern)


class CheckpointConversion:
    """Which checkpoint keys give each state tensor of ``model``, and how (transformers' mapping).

    Args:
        model: The generic (transformers) model, possibly parallelised.
        keys: Every key of the checkpoint folder, with the file that holds it (for messages).
    """

    def __init__(self, model: nn.Module, keys: Mapping[str, object]) -> None:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.model = model
        self.files = keys
        transforms = _conversions(model, saving=False)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        present = {name: True for name, _ in state_tensors(model)}
        prefix = str(getattr(model, "base_model_prefix", ""))
        self._by_target: dict[str, _Group] = {}
        groups: dict[str, _Group] = {}
        for key in sorted(keys, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, present)
            if renamed not in present and key in present:
                renamed, pattern = key, None
            if renamed not in present:
                continue  # no place in the model: the loader reports it
            group = groups.get(renamed)
            if group is None:
                if pattern is None:
                    group = _Group(WeightRenaming(key, renamed), renamed)
                    targets = [renamed]
                else:
                    converter = by_pattern[pattern]
                    group = _Group(copy.deepcopy(converter), renamed)
                    first = converter.target_patterns[0]
                    targets = [renamed.replace(first, t) for t in converter.target_patterns]
                groups[renamed] = group
                for target in targets:
                    if target in present:
                        self._by_target.setdefault(target, group)
            group.sources.append((key, pattern or key))
        # What from_pretrained leaves on a loaded model: the transforms its checkpoint used, for export.
        model._weight_conversions = [t for t in transforms if t.was_used()]  # type: ignore[assignment]
        self.converted = any(isinstance(g.transform, WeightConverter) for g in groups.values())

    def sources(self, name: str) -> list[str]:
        """The checkpoint keys of state tensor ``name`` (``[name]`` when none matched: reported missing)."""
        group = self._by_target.get(name)
        return [key for key, _ in group.sources] if group is not None else [name]

    def convert(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """State tensor ``name`` from its checkpoint tensors, by the group's transform.

        Raises:
            ValueError: When transformers' operations fail or do not produce ``name``.
        """
        group = self._by_target.get(name)
        if group is None:
            (tensor,) = tensors.values()
            return tensor
        transform = copy.deepcopy(group.transform)
        for key, pattern in group.sources:
            # A tensor in place of a loading future: transformers' own export path passes tensors too.
            transform.add_tensor(group.first, key, pattern, tensors[key])  # type: ignore[arg-type]
        try:
            result = transform.convert(
                group.first, model=self.model, config=getattr(self.model, "config", None)
            )
        except (RuntimeError, ValueError, IndexError) as err:
            counts: dict[str, int] = {}
            for _, pattern in group.sources:
                counts[pattern] = counts.get(pattern, 0) + 1
            found = ", ".join(f"{n} x {pattern}" for pattern, n in counts.items())
            raise ValueError(
                f"{self.files.get(group.sources[0][0], '?')}: {name}: transformers' {type(transform).__name__} "
                f"from {group.sources[0][0]} and {len(group.sources) - 1} more keys failed ({found} found; "
                f"{type(err).__name__}: {str(err).strip().splitlines()[0]})"
            ) from None
        value = result.get(name)
        if value is None:
            raise ValueError(
                f"{name}: transformers' conversion {transform!r} gave {sorted(result)}, not {name}"
            )
        return value[0] if isinstance(value, list) else value


class ExportConversion:
    """``revert_weight_conversion`` one group at a time: the state tensors a reversed converter reads together."""

    def __init__(self, model: nn.Module) -> None:
        from transformers.core_model_loading import WeightConverter, apply_converters

        self.model = model
        reverse = [t.reverse_transform() for t in _conversions(model, saving=True)[::-1]]
        converters = [t for t in reverse if isinstance(t, WeightConverter)]
        self._group_of: dict[str, str] = {}
        self._members: dict[str, set[str]] = {}
        for name, _ in state_tensors(model):
            renamed, pattern = apply_converters(name, converters)
            group = renamed if pattern is not None else name
            self._group_of[name] = group
            self._members.setdefault(group, set()).add(name)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors once every member of ``name``'s group has arrived (else ``{}``)."""
        from transformers.core_model_loading import revert_weight_conversion

        group = self._group_of.get(name, name)
        pending = self._pending.setdefault(group, {})
        pending[name] = tensor
        if set(pending) < self._members.get(group, {name}):
            return {}
        del self._pending[group]
        return dict(revert_weight_conversion(self.model, pending))  # type: ignore[arg-type]


class GenericHFAdapter(HFAdapterBase):
    """The generic path's ``HFStateDictAdapter``: transformers' conversions, its own config.json body.

    Unbound it maps every name to itself; ``meshforge.checkpoint.hf`` binds it to the model and
    the checkpoint's keys (``bind_checkpoint``) before loading and to the model (``bind_model``)
    before exporting.
    """

    def __init__(self, spec: AdapterFamily, args: ModelArgs | None = None) -> None:
        super().__init__(spec, args)
        self._load: CheckpointConversion | None = None
        self._export: ExportConversion | None = None

    @property
    def renames_only(self) -> bool:  # type: ignore[override]
        # A converted tensor is read whole (a converter's source is not the parameter's layout).
        return self._load is None or not self._load.converted

    def bind_checkpoint(self, model: nn.Module, keys: Mapping[str, object]) -> None:
        self._load = CheckpointConversion(model, keys)

    def bind_model(self, model: nn.Module) -> None:
        self._export = ExportConversion(model)

    def hf_sources(self, name: str) -> list[str]:
        return self._load.sources(name) if self._load is not None else [name]

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._load is None:
            return super().from_hf(name, tensors)
        return self._load.convert(name, tensors)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._export.to_hf(name, tensor) if self._export is not None else {name: tensor}

    def to_hf_config(self, args: ModelArgs) -> dict[str, object]:
        body = to_hf_config(args)
        body.setdefault("model_type", self.spec.name)
        body.setdefault("architectures", [self.architecture])
        return body


def to_hf_config(config: Any) -> dict[str, object]:
    """config.json body of a generic model: transformers' own config, as ``save_pretrained`` writes it."""
    body: dict[str, object] = config.to_dict()
    body.pop("_name_or_path", None)
    return body


def bind_generic(adapter: object, model: nn.Module, keys: Mapping[str, object] | None = None) -> bool:
    """Bind ``adapter`` when it is the generic path's: to ``keys`` (key -> file) to load, else to export.

    Returns:
        Whether it was (then the model's persistent buffers travel with its parameters).
    """
    if not isinstance(adapter, GenericHFAdapter):
        return False
    if keys is None:
        adapter.bind_model(model)
    else:
        adapter.bind_checkpoint(model, keys)
    return True


__all__ = [
    "CheckpointConversion",
    "ExportConversion",
    "GenericHFAdapter",
    "bind_generic",
    "persistent_buffers",
    "state_tensors",
    "to_hf_config",
]
