"""Expert parallelism on the transformers path: its fused experts modules with a known layout.

transformers 5.x builds the experts of its MoE models as one module with fused weights, decorated
with ``integrations.moe.use_experts_implementation``, which records the weight layout on the
instance (``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated``,
``has_post_expert_norm``). The Mixtral-like and Qwen3-MoE-like layout is the one meshforge's own
``GroupedExperts`` has: ``gate_up_proj [experts, 2 * ffn, hidden]`` (gate rows, then up rows),
``down_proj [experts, hidden, ffn]``, no biases, ``act_fn(gate) * up``. Such a module called as
``experts(hidden_states, top_k_index, top_k_weights)`` gets the same treatment as a built-in one:
``apply_ep`` makes its two weights ``Shard(0)`` DTensors on the ep mesh and its forward becomes the sort /
all-to-all / local experts / all-to-all back of ``meshforge.models.common.moe.dispatch_to_experts``
and the token exchange ``apply_ep`` hands over. Any other experts module (biases, interleaved or
transposed weights, a post-expert norm, or an undecorated class) is refused, naming its class.
:class:`FusedExpertsAdapter` is the spec's ``ep_adapter`` (``models/spec.py``: ``ExpertsAdapter``).
"""

from __future__ import annotations

import inspect
import types
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshforge.models.common.moe import dispatch_to_experts, group_sizes

if TYPE_CHECKING:
    from meshforge.models.common.moe import TokenExchange

#: The layout flags ``use_experts_implementation`` sets, and the values the EP forward handles.
KNOWN_LAYOUT = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}
_CALL = ("hidden_states", "top_k_index", "top_k_weights")


def layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not a transformers experts module of the known layout (None when it is)."""
    for flag, value in KNOWN_LAYOUT.items():
        if getattr(module, flag, None) is not value:
            return f"{flag} is {getattr(module, flag, 'not set')}, EP needs {value}"
    names = sorted(name for name, _ in module.named_parameters(recurse=False))
    if names != ["down_proj", "gate_up_proj"]:
        return f"its parameters are {names}, EP needs exactly gate_up_proj and down_proj"
    experts = getattr(module, "num_experts", None)
    gate_up, down = module.get_parameter("gate_up_proj"), module.get_parameter("down_proj")
    if not isinstance(experts, int) or gate_up.ndim != 3 or down.ndim != 3:
        return "it has no int num_experts or its weights are not [experts, out, in]"
    ffn, hidden = down.shape[2], down.shape[1]
    if tuple(gate_up.shape) != (experts, 2 * ffn, hidden) or down.shape[0] != experts:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2F, H] and [E, H, F]"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    params = list(inspect.signature(type(module).forward).parameters)[1:4]
    if tuple(params) != _CALL:
        return f"its forward takes {params}, EP needs {list(_CALL)}"
    return None


class FusedExpertsAdapter:
    """The ``ExpertsAdapter`` of transformers' fused experts (the modules ``parallelism.ep_modules`` names)."""

    def check_dispatcher(self, token_dispatcher: str) -> None:
        """Only ``alltoall``: the experts take the expert-sorted tokens, not each token with its k experts.

        Raises:
            NotImplementedError: For any other ``parallelism.moe_token_dispatcher_type``.
        """
        if token_dispatcher != "alltoall":
            raise NotImplementedError(
                f"not supported yet: parallelism.moe_token_dispatcher_type={token_dispatcher!r} on the generic "
                "transformers path (its experts take the expert-sorted tokens only); use alltoall"
            )

    def check(self, name: str, module: nn.Module) -> None:
        """Refuse a matched module that is not of the known layout, naming its class and why.

        Raises:
            NotImplementedError: See :func:`layout_problem`.
        """
        problem = layout_problem(module)
        if problem is not None:
            raise NotImplementedError(
                f"not supported yet: parallelism.expert_parallel > 1 for {type(module).__name__} ({name}, "
                f"parallelism.ep_modules): {problem}; the generic path shards transformers' fused experts "
                "of the Mixtral / Qwen3-MoE layout (gate_up_proj [E, 2F, H], down_proj [E, H, F], no bias)"
            )

    def use_exchange(self, module: nn.Module, exchange: TokenExchange) -> None:
        """Give an experts module whose weights ``apply_ep`` sharded the all-to-all forward (in place)."""
        # A plain attribute, where nn.Module keeps it (``is_expert_parallel`` looks there).
        module.__dict__["token_exchange"] = exchange
        target: nn.Module = module
        # Per instance, through nn.Module's own `forward: Callable[..., Any]` slot.
        target.forward = types.MethodType(_ep_forward, module)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _local_experts(module: nn.Module, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
    """Outputs of the experts held here for rows sorted by local expert (``counts`` rows each)."""
    if grouped.shape[0] == 0:
        return None
    gate_up, down = _local(module.get_parameter("gate_up_proj")), _local(module.get_parameter("down_proj"))
    outputs = []
    for expert, rows in enumerate(grouped.split(group_sizes(grouped, counts))):
        hidden = module._apply_gate(F.linear(rows, gate_up[expert]))  # type: ignore[operator]
        outputs.append(F.linear(hidden, down[expert]))
    return torch.cat(outputs)


def _ep_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward with the experts spread over the ep ranks."""
    exchange: TokenExchange = self.token_exchange  # type: ignore[assignment]
    experts = int(self.num_experts)  # type: ignore[arg-type]
    counts = torch.bincount(top_k_index.reshape(-1), minlength=experts)

    def compute(grouped: torch.Tensor) -> torch.Tensor | None:
        return exchange(grouped, counts, lambda rows, local: _local_experts(self, rows, local))

    weights = top_k_weights.to(hidden_states.dtype)
    return dispatch_to_experts(hidden_states, top_k_index, weights, compute)


__all__ = ["KNOWN_LAYOUT", "FusedExpertsAdapter", "layout_problem"]
