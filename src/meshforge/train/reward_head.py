"""The value head of a reward model (`training.stage: rm`), attached to any family's causal LM.

The head is `score`, a bias-free `nn.Linear(hidden, 1)` on the model root: the name and shape of
transformers' `*ForSequenceClassification.score`, so the export is that class's folder and the
DCP state holds it as `score.weight` next to the base weights. It is added on the meta device
before the model is parallelised, by the same path for every family (the hidden size is the LM
head's input size): FSDP shards it with the root's parameters, and under tensor parallelism it
is a replicated DTensor (every TP rank gathers the hidden states and scores every pair, as the
preference losses do). With LoRA it stays trainable, in the parameter dtype
(`LoraSettings.trainable_modules`, PEFT's `modules_to_save`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshforge.models.materialize import InitFn

HEAD = "score"
HEAD_WEIGHT = f"{HEAD}.weight"


def hidden_size(model: nn.Module) -> int:
    """The width of the final hidden states: the LM head's input size (every causal family has one)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        return int(head.in_features)
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    if size is None:
        raise ValueError(
            "training.stage: rm: the model has no lm_head and no config.hidden_size to size the value head"
        )
    return int(size)


def init_std(model: nn.Module) -> float:
    """The head's init standard deviation: the model's `initializer_range` (transformers' choice)."""
    return float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)


def attach_value_head(model: nn.Module, *, tp_mesh: DeviceMesh | None = None) -> nn.Linear:
    """Add `score` to `model` (meta device, before parallelisation), replicated over `tp_mesh`."""
    sample = next(model.parameters())
    head = nn.Linear(hidden_size(model), 1, bias=False, device=sample.device, dtype=sample.dtype)
    if tp_mesh is not None:
        from torch.distributed.tensor import Replicate, distribute_tensor

        head.weight = nn.Parameter(distribute_tensor(head.weight.data, tp_mesh, [Replicate()]))
    model.add_module(HEAD, head)
    return head


def freeze_lm_head(model: nn.Module) -> bool:
    """Freeze an untied LM head, which a reward model never runs; True when one was frozen.

    It gets no gradient, so training it would only leave the optimizer without its state (and a
    resumed run without the state it expects). A head tied to the input embedding is that
    embedding and keeps training. The weights stay in the model and its checkpoints.
    """
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(weight, nn.Parameter):
        return False
    owners = [name for name, p in model.named_parameters(remove_duplicate=False) if p is weight]
    if len(owners) > 1:
        return False
    weight.requires_grad_(False)
    return True


def value_head(model: nn.Module) -> nn.Linear:
    """The model's value head (after `attach_value_head`)."""
    head = model._modules.get(HEAD)
    if not isinstance(head, nn.Linear):
        raise ValueError("training.stage: rm: the model has no value head (score)")
    return head


@contextlib.contextmanager
def value_head_detached(model: nn.Module) -> Iterator[nn.Linear | None]:
    """Take `score` off for the duration, so the model shows the base model's parameters only.

    For the Hugging Face loader and exporter, which walk the causal LM's keys; the same module is
    put back, so FSDP and optimizer references stay valid. No forward may run inside.
    """
    head = cast("nn.Linear | None", model._modules.pop(HEAD, None))
    try:
        yield head
    finally:
        if head is not None:
            model._modules[HEAD] = head


def with_head_init(base_init: InitFn, std: float) -> InitFn:
    """An init function that draws `score.weight` from N(0, std) and leaves the rest to `base_init`.

    Seeded per parameter name like every other weight (`materialize_and_init`), so any layout
    draws the same head; a loaded base checkpoint never covers it.
    """

    def init(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name == HEAD_WEIGHT:
            tensor.normal_(0.0, std, generator=generator)
        else:
            base_init(name, tensor, generator)

    return init
