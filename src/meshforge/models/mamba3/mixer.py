"""The Mamba-3 mixer layer in plain PyTorch (the reference's ``Mamba3`` module, same parameters).

One ``in_proj`` gives, per token, ``[z, x, B, C, dd_dt, dd_A, trap, angles]`` (the reference's
order, so its ``in_proj.weight`` loads as it is). Then:

* ``dt = softplus(dd_dt + dt_bias)``; the data-dependent ``A = -max(heavy_tail(dd_A), A_floor)``;
  ``lambda = sigmoid(trap)`` weighs the trapezoid's two ends;
* B and C are RMS-normed over the state in float32 (``B_norm``, ``C_norm`` hold the weights,
  shared by the heads of a group), get a per-head bias (``B_bias``, ``C_bias``, ones at init) and are rotated by the
  cumulative data-dependent angles ``theta_t = sum pi tanh(angles) dt`` (the complex-valued
  state written as real rotations, on ``rope_fraction`` of the state);
* MIMO (``is_mimo``): ``x`` and ``z`` are spread over ``mimo_rank`` channels per head by
  ``mimo_x``/``mimo_z`` and the ``R`` outputs summed back with ``mimo_o``; SISO is rank 1
  without those weights;
* the scan (``scan.py``), the ``D`` skip, then the gate: ``y * silu(z)``, or with
  ``is_outproj_norm`` a per-head RMSNorm before the gate (``norm``), and ``out_proj``.

Under tensor parallelism each rank keeps whole heads (``parallelize.py``); the attributes
``num_heads`` and ``n_groups`` are then the local counts.

Generation (``state_cache``, a :class:`Mamba3State` set by ``meshforge.infer.kv_cache``): the
prompt runs the training forward and leaves the state after its last token; each later forward
continues it token by token. The state is what the recurrence carries: ``h``, the last token's
input (the trapezoid's look-back end) and the cumulative rotary angle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.norms import RMSNorm
from meshforge.models.mamba3.args import Mamba3Args
from meshforge.models.mamba3.scan import (
    chunked_scan,
    continue_scan,
    final_state,
    heavy_tail,
    recurrent_scan,
    rotary_angles,
    rotate_pairs,
)

SCANS = ("chunked", "recurrent")


@dataclass
class Mamba3State:
    """One mixer's generation state between forwards (``Mamba3Mixer.state_cache``).

    Left padding needs no mask here: its positions make it a document of its own
    (``document_index``), so the prompt's state starts at its first real token and
    ``token_mask`` is not read.

    Attributes:
        recurrent: ``[B, H, P, N]`` ``h`` after the last token (None before the prompt).
        look_back: ``[B, H, P, N]`` the last token's input ``sum_r v k^T``.
        angle: ``[B, H, A]`` the rotary angle ``theta`` of the last token.
        token_mask: Set by the cache (``[B, S_new]``, False on padding); unused.
    """

    recurrent: torch.Tensor | None = None
    look_back: torch.Tensor | None = None
    angle: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.recurrent, self.look_back, self.angle) if t is not None)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search)."""
        if self.recurrent is not None and self.look_back is not None and self.angle is not None:
            self.recurrent = self.recurrent.index_select(0, index)
            self.look_back = self.look_back.index_select(0, index)
            self.angle = self.angle.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes of the three tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors())


class Mamba3Mixer(nn.Module):
    """One Mamba-3 token mixer (``hidden_size`` in and out).

    Args:
        args: Structural hyper-parameters.
    """

    def __init__(self, args: Mamba3Args) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.n_groups = args.n_groups
        self.head_dim = args.head_dim
        self.state_size = args.state_size
        self.rank = args.rank
        self.is_mimo = args.is_mimo
        self.is_outproj_norm = args.is_outproj_norm
        self.num_rope_angles = args.num_rope_angles
        self.A_floor = float(args.A_floor)
        self.eps = float(args.norm_eps)
        self.chunk_size = args.chunk_size
        # "recurrent" runs the token-by-token form (the benchmark's and tests' reference).
        self.scan = "chunked"
        h, p, n, r = self.num_heads, self.head_dim, self.state_size, self.rank
        bc = n * self.n_groups * r
        self.in_proj = nn.Linear(
            args.hidden_size, 2 * h * p + 2 * bc + 3 * h + self.num_rope_angles, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.B_bias = nn.Parameter(torch.ones(h, r, n))
        self.C_bias = nn.Parameter(torch.ones(h, r, n))
        self.B_norm = RMSNorm(n, self.eps)
        self.C_norm = RMSNorm(n, self.eps)
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((h, r, p), 1.0 / r))
            self.mimo_z = nn.Parameter(torch.ones(h, r, p))
            self.mimo_o = nn.Parameter(torch.full((h, r, p), 1.0 / r))
        self.D = nn.Parameter(torch.ones(h))
        if self.is_outproj_norm:
            self.norm = RMSNorm(h * p, self.eps)
        self.out_proj = nn.Linear(h * p, args.hidden_size, bias=False)
        # Set by meshforge.infer.kv_cache during generation; None in training.
        self.state_cache: Mamba3State | None = None

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Mix ``x`` ``[B, S, hidden]`` along time; ``doc`` ``[B, S]`` restarts the state per document."""
        batch, seq, _ = x.shape
        h, p, n, r, g = self.num_heads, self.head_dim, self.state_size, self.rank, self.n_groups
        sizes = [h * p, h * p, r * g * n, r * g * n, h, h, h, self.num_rope_angles]
        z, xs, b, c, dd_dt, dd_a, trap, angles = self.in_proj(x).split(sizes, dim=-1)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        dt = F.softplus(dd_dt.to(work) + self.dt_bias.to(work))
        adt = -heavy_tail(dd_a.to(work)).clamp_min(self.A_floor) * dt
        lam = torch.sigmoid(trap.to(work))
        theta = self._angles(angles, dt, doc)[:, :, None]  # [B, S, 1, H, A]
        cos, sin = theta.cos(), theta.sin()
        k = self._keys(b, self.B_norm, self.B_bias, cos, sin)
        q = self._keys(c, self.C_norm, self.C_bias, cos, sin)
        xs = xs.reshape(batch, seq, 1, h, p).to(work)
        v = xs * self.mimo_x.transpose(0, 1).to(work) if self.is_mimo else xs
        y = self._scan(q, k, v, adt, dt, lam, doc)
        y = y + self.D.to(work)[:, None] * v
        gate = z.reshape(batch, seq, 1, h, p).to(work)
        if self.is_mimo:
            gate = gate * self.mimo_z.transpose(0, 1).to(work)
        if self.is_outproj_norm:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            y = y * self.norm.weight.to(work).view(h, p)
        y = y * F.silu(gate)
        y = (y * self.mimo_o.transpose(0, 1).to(work)).sum(2) if self.is_mimo else y[:, :, 0]
        return self.out_proj(y.reshape(batch, seq, h * p).to(x.dtype))

    def _angles(self, angles: torch.Tensor, dt: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
        """``theta`` ``[B, S, H, A]``, continuing the cached angle after the prompt."""
        state = self.state_cache
        if state is None or state.angle is None:
            theta = rotary_angles(angles, dt, doc)
        else:
            theta = state.angle[:, None] + rotary_angles(angles, dt, None)
        if state is not None:
            state.angle = theta[:, -1]
        return theta

    def _scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        adt: torch.Tensor,
        dt: torch.Tensor,
        lam: torch.Tensor,
        doc: torch.Tensor | None,
    ) -> torch.Tensor:
        """The recurrence's outputs; with a cache, entered with (and leaving) its state."""
        state = self.state_cache
        if state is not None and state.recurrent is not None and state.look_back is not None:
            y, state.recurrent, state.look_back = continue_scan(
                q, k, v, adt, dt, lam, state.recurrent, state.look_back
            )
            return y
        if state is not None:  # the prompt: the training forward, then the state it ends in
            state.recurrent, state.look_back = final_state(k, v, adt, dt, lam, doc)
        if self.scan == "recurrent":
            return recurrent_scan(q, k, v, adt, dt, lam, doc)
        return chunked_scan(q, k, v, adt, dt, lam, doc, chunk_size=self.chunk_size)

    def _keys(
        self, t: torch.Tensor, norm: RMSNorm, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """B or C ``[B, S, R * G * N]`` -> normed, per-head biased and rotated ``[B, S, R, H, N]``."""
        batch, seq, _ = t.shape
        h, g, work = self.num_heads, self.n_groups, cos.dtype
        # RMS-normed in the scan's precision (float32, or float64 for a float64 model).
        t = t.reshape(batch, seq, self.rank, g, self.state_size).to(work)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) * norm.weight.to(work)
        if g != h:
            t = t.repeat_interleave(h // g, dim=3)
        return rotate_pairs(t + bias.transpose(0, 1).to(work), cos, sin)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, state={self.state_size}, "
            f"rank={self.rank}, groups={self.n_groups}, chunk_size={self.chunk_size}, scan={self.scan}"
        )


def init_dt_bias_(tensor: torch.Tensor, args: Mamba3Args, generator: torch.Generator) -> None:
    """``dt_bias`` as the reference draws it: the inverse softplus of ``dt`` log-uniform in
    ``[dt_min, dt_max]`` (floored at ``dt_init_floor``)."""
    lo, hi = math.log(args.dt_min), math.log(args.dt_max)
    with torch.no_grad():
        dt = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
        dt.uniform_(0.0, 1.0, generator=generator)
        dt = (dt * (hi - lo) + lo).exp().clamp_min(args.dt_init_floor)
        tensor.copy_(dt + torch.log(-torch.expm1(-dt)))


__all__ = ["SCANS", "Mamba3Mixer", "Mamba3State", "init_dt_bias_"]
