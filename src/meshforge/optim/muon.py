"""`optimizer.type: Muon`: one optimizer object holding a Muon part and an AdamW part.

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonlight) replaces the update of a
hidden weight matrix by the orthogonalised momentum: with gradient g and buffer B,

    B <- momentum * B + (1 - momentum) * g          (torch.optim.Muon's `lerp` form)
    U <- g + momentum * (B - g)  if nesterov else B
    O <- NS_k(U / max(||U||_F, ns_eps))             (quintic Newton-Schulz, coefficients a, b, c)
    W <- W * (1 - lr * weight_decay) - lr * s(rows, cols) * O

with `s = matched_adamw_rms * sqrt(max(rows, cols))` (`match_rms_adamw`, the default: the
update RMS matches AdamW's, so AdamW's learning rate and weight decay carry over) or
`s = sqrt(max(1, rows / cols))` (Keller Jordan's original). The other parameters
(`optim/muon_split.py`) are updated by a `torch.optim.AdamW` that shares this optimizer's
parameter-group dicts and state, so the LR schedule, gradient clipping, `zero_grad` and DCP see
one optimizer with one state dict.

Differences from `torch.optim.Muon` (the same update otherwise, see tests/unit/test_muon.py):
torch always runs Newton-Schulz in bfloat16, meshforge in the parameter dtype unless
`ns_bfloat16: true` (CPU bfloat16 matmuls are slow, and float32 makes runs on different layouts
comparable to 1e-5); torch accepts only 2-D parameters, meshforge also takes each expert matrix
of a `[E, out, in]` weight; torch's `match_rms_adamw` factor is fixed at 0.2, here it is
`matched_adamw_rms`. With FSDP/TP the matrices are orthogonalised by one owner rank each
(`optim/muon_dist.py`).

Parameter groups: Muon decay, Muon no decay, then AdamW decay, AdamW no decay (and the plain
tensors of a mixed DTensor/plain model, as for AdamW): group order and count are fixed for a
model, which DCP relies on when it restores group hyperparameters by index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import Tensor

from meshforge.optim.muon_dist import MatrixOrthogonalizer
from meshforge.utils.distributed import local_tensor

__all__ = ["MeshMuon", "newton_schulz", "optimizer_family", "update_scale"]


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    """`Muon` or `AdamW` (also FusedAdamW): whose state a checkpoint of `optimizer` holds."""
    return "Muon" if isinstance(optimizer, MeshMuon) else "AdamW"


def newton_schulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Approximately orthogonalise each matrix of `update` (`[..., rows, cols]`).

    The operations are those of `torch.optim.Muon` (divide by the Frobenius norm, transpose tall
    matrices, `steps` quintic iterations through `addmm`), so that for 2-D input in bfloat16 the
    result is the same; a batch of matrices (experts) is done with `baddbmm`.
    """
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if x.dim() == 2:
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        shape = x.shape
        x = x.reshape(-1, *shape[-2:])
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        x = x.reshape(shape)
    return x.mT if tall else x


def update_scale(rows: int, cols: int, *, match_rms_adamw: bool, matched_adamw_rms: float) -> float:
    """The factor the learning rate is multiplied by for a `rows x cols` matrix."""
    if match_rms_adamw:
        return matched_adamw_rms * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class AdamWArgs(TypedDict, total=False):
    """The `torch.optim.AdamW` keyword arguments of the AdamW part (lr and groups aside)."""

    betas: tuple[float, float]
    eps: float
    amsgrad: bool
    fused: bool | None
    foreach: bool | None


class MeshMuon(torch.optim.Optimizer):
    """Muon for the groups marked `muon: True`, `torch.optim.AdamW` for the others.

    Args:
        muon_groups: dicts with `params`, `weight_decay`; the Muon hyperparameters are defaults.
        adamw_groups: dicts with `params`, `weight_decay`.
        lr: initial learning rate of every group (the scheduler sets it per step).
        adamw: keyword arguments of `torch.optim.AdamW` (betas, eps, amsgrad, fused, foreach).
        momentum, nesterov, ns_coefficients, ns_steps, ns_eps, match_rms_adamw,
        matched_adamw_rms: as `MuonOptions` (`optim/options.py`).
        ns_dtype: dtype of the Newton-Schulz iteration (None: the parameter's dtype).
    """

    def __init__(
        self,
        muon_groups: list[dict[str, object]],
        adamw_groups: list[dict[str, object]],
        *,
        lr: float,
        adamw: AdamWArgs,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        ns_eps: float,
        match_rms_adamw: bool,
        matched_adamw_rms: float,
        ns_dtype: torch.dtype | None,
    ) -> None:
        muon_defaults = {
            "muon": True,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "ns_steps": ns_steps,
            "ns_eps": ns_eps,
            "match_rms_adamw": match_rms_adamw,
            "matched_adamw_rms": matched_adamw_rms,
        }
        groups = [{**muon_defaults, **g} for g in muon_groups]
        # Empty groups are kept: the group count is then the same on every pipeline stage.
        self._adamw = torch.optim.AdamW([{"muon": False, **g} for g in adamw_groups], lr=lr, **adamw)
        groups += self._adamw.param_groups
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})
        self._adamw.state = self.state
        self._ns_dtype = ns_dtype
        self._orth = MatrixOrthogonalizer([p for g in self.param_groups if g["muon"] for p in g["params"]])

    def _rebind(self) -> None:
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Load, then point the AdamW part at the loaded group dicts and state again.

        A group without parameters (Muon's no-decay group, usually) has no entry in a DCP
        checkpoint, which stores hyperparameters per parameter: it keeps its current ones.
        """
        before = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, old in zip(self.param_groups, before, strict=True):
            for key, value in old.items():
                group.setdefault(key, value)
        self._rebind()

    @property
    def orthogonalizer(self) -> MatrixOrthogonalizer:
        """The distributed Newton-Schulz step (owner assignment, bytes moved)."""
        return self._orth

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(not g["muon"] for g in self.param_groups):
            self._rebind()
            self._adamw.step()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:  # one of torch's param_groups
        params = [p for p in group["params"] if p.grad is not None]
        updates: list[Tensor] = []
        for p in params:
            state = self.state[p]
            grad = p.grad
            assert grad is not None
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            # Element-wise on the local shards: DTensor dispatch would add nothing but overhead.
            buf, g = local_tensor(state["momentum_buffer"]), local_tensor(grad)
            buf.lerp_(g, 1 - group["momentum"])
            updates.append(g.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
        ortho = self._orth.orthogonalize(
            params,
            updates,
            lambda u: newton_schulz(
                u,
                group["ns_coefficients"],
                group["ns_steps"],
                group["ns_eps"],
                self._ns_dtype or u.dtype,
            ),
        )
        lr = float(group["lr"])
        for p, o in zip(params, ortho, strict=True):
            rows, cols = p.shape[-2], p.shape[-1]
            scale = update_scale(
                rows,
                cols,
                match_rms_adamw=group["match_rms_adamw"],
                matched_adamw_rms=group["matched_adamw_rms"],
            )
            w = local_tensor(p)
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(o.to(w.dtype), alpha=-lr * scale)
