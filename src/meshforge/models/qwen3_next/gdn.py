"""Gated DeltaNet in plain PyTorch: the chunked gated delta rule, its causal conv, its gated norm.

The token mixer of Qwen3-Next's linear-attention layers keeps, per value head, a state
``S`` of shape ``[d_k, d_v]`` and updates it token by token (the gated delta rule)::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

with ``g_t <= 0`` a log decay, ``beta_t`` in (0, 1) the write strength and q, k
L2-normalised (q also scaled by ``d_k ** -0.5``). :func:`recurrent_gated_delta_rule`
runs exactly that loop; it is the reference the tests hold the chunked form to.

Chunked form (:func:`chunk_gated_delta_rule`), derived for a chunk of ``C`` tokens
entered with state ``S_0``. With ``G_i`` the cumulative log decay inside the chunk,
``D_ij = exp(G_i - G_j)`` and the per-token write ``u_i = beta_i (v_i - (exp(g_i)
S_{i-1})^T k_i)``, unrolling the recurrence gives ``S_i = exp(G_i) S_0 + sum_{j<=i}
D_ij k_j u_j^T``. Substituting that into ``u_i`` gives a unit lower-triangular system
``(I + A) U = diag(beta) V - diag(beta exp(G)) K S_0`` with ``A_ij = beta_i D_ij
k_i . k_j`` for ``j < i`` (the WY/UT representation), so with ``T = (I + A)^-1``::

    U = T diag(beta) V - W S_0,            W = T diag(beta exp(G)) K
    O = diag(exp(G)) Q S_0 + ((Q K^T) * D)_{j<=i} U
    S_C = exp(G_C) S_0 + (K * exp(G_C - G))^T U

Everything inside a chunk is a handful of matmuls and one triangular solve; only the
state is carried from chunk to chunk. ``chunk_size`` (``kernels.gdn_chunk_size``)
changes the grouping, not the result (equal to rounding).

Packed documents: a document start resets the state (and the conv window) as if
the row began there. A reset before token r is a decay of zero at r, which in the
formulas above just zeroes every ``D_ij``, ``exp(G_i)`` or ``exp(G_C - G_j)`` whose
span crosses a segment boundary. Those factors are multiplied by "same segment"
masks instead of pushing ``-inf`` into the log decays (which would make the
cumulative sums NaN or lose float32 precision).

Numerics follow transformers: the rule runs in float32 whatever the compute dtype,
L2 normalisation as ``x * rsqrt(sum(x^2) + 1e-6)``.

Context parallelism (ulysses; ``GatedDeltaNet.cp`` set by ``apply_cp``): the conv and the
recurrence need whole rows, but they are independent per head. So right after the two
projections one all-to-all turns "all heads, 1/cp of the row" into "1/cp of the key-head
groups (each key head with the value heads it serves), the whole row", the conv runs on
those heads' channels, the rule on their decays, with the full row's document ids, and
a second all-to-all turns the rule's output back before the gated norm (per token and
value head, so it stays local with the output gate ``z``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.common.mlp import activation
from meshforge.models.common.norms import RMSNorm


class UlyssesPlan(Protocol):
    """What the Gated DeltaNet reads of its CP plan (``meshforge.parallel.context.ContextParallel``)."""

    ulysses_size: int
    rank: int

    def seq_to_heads(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor: ...


class RowMask(Protocol):
    """What the Gated DeltaNet reads of the CP mask (``meshforge.parallel.context.CPMask``)."""

    seq_len: int
    segments: torch.Tensor | None


DEFAULT_CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the formulation transformers uses)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Repeat q/k heads over their value heads, move heads before time, float32, normalise q and k."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads != num_k_heads:
        # Each q/k head serves num_v // num_k consecutive value heads.
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    q = l2norm(q) * q.shape[-1] ** -0.5
    return q, l2norm(k), v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule token by token (the reference for :func:`chunk_gated_delta_rule`).

    Args:
        q: Queries ``[B, S, Hk, Dk]`` (not yet normalised).
        k: Keys ``[B, S, Hk, Dk]`` (not yet normalised).
        v: Values ``[B, S, Hv, Dv]``; ``Hv`` a multiple of ``Hk``.
        g: Log decays ``[B, S, Hv]`` (<= 0).
        beta: Write strengths ``[B, S, Hv]``.
        segment_ids: Optional ``[B, S]`` document ids; the state restarts at zero where
            the id changes.

    Returns:
        Outputs ``[B, S, Hv, Dv]`` in ``v``'s dtype.
    """
    return _recurrent_rule(q, k, v, g, beta, segment_ids=segment_ids)[0]


def _recurrent_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`recurrent_gated_delta_rule` entered with ``initial_state``; also returns the final state."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, seq_len, dk = k.shape
    state = v.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(seq_len):
        decay = g[:, :, t].exp()[..., None, None]
        if segment_ids is not None and t > 0:
            keep = (segment_ids[:, t] == segment_ids[:, t - 1]).to(state.dtype)
            decay = decay * keep[:, None, None, None]
        state = state * decay
        k_t = k[:, :, t]
        write = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * write[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outputs, dim=2).transpose(1, 2).to(dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over chunks of ``chunk_size`` tokens (see the module docstring).

    Args:
        q: Queries ``[B, S, Hk, Dk]`` (not yet normalised).
        k: Keys ``[B, S, Hk, Dk]`` (not yet normalised).
        v: Values ``[B, S, Hv, Dv]``; ``Hv`` a multiple of ``Hk``.
        g: Log decays ``[B, S, Hv]`` (<= 0).
        beta: Write strengths ``[B, S, Hv]``.
        chunk_size: Tokens per chunk (``kernels.gdn_chunk_size``).
        segment_ids: Optional ``[B, S]`` document ids; the state restarts at zero where
            the id changes (adjacent documents must carry different ids).

    Returns:
        Outputs ``[B, S, Hv, Dv]`` in ``v``'s dtype.
    """
    return _chunk_rule(q, k, v, g, beta, chunk_size=chunk_size, segment_ids=segment_ids)[0]


def _chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    segment_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` entered with ``initial_state`` ``[B, Hv, Dk, Dv]`` (float32, None:
    zero); also returns the state after the last token (padded tail tokens change nothing)."""
    if chunk_size <= 0:
        raise ValueError(f"kernels.gdn_chunk_size: must be a positive integer, got {chunk_size}")
    dtype = v.dtype
    seq_len = v.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, _, dk = k.shape
    dv = v.shape[-1]
    pad = -seq_len % chunk_size
    if pad:
        # Zero keys/values/betas and zero log decay: padded tokens change nothing before them.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (seq_len + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, num_chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, num_chunks, chunk_size) for x in (g, beta))

    cum = g.cumsum(dim=-1)  # G_i, per chunk
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # D_ij = exp(G_i - G_j) for j <= i; the upper triangle is masked before exp (it would overflow).
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    from_start = cum.exp()  # exp(G_i): state entering the chunk -> token i
    to_end = (cum[..., -1:] - cum).exp()  # exp(G_C - G_j): token j -> state leaving the chunk
    whole = cum[..., -1].exp()  # exp(G_C)

    if segment_ids is not None:
        seg = segment_ids.to(q.device)
        if pad:
            seg = F.pad(seg, (0, pad), value=-1)
        seg = seg.reshape(batch, 1, num_chunks, chunk_size)
        # The token before each chunk (a "segment" of its own before the row starts).
        before = torch.cat([torch.full_like(seg[..., :1, :1], -2), seg[..., :-1, -1:]], dim=2)
        decay = decay * (seg[..., :, None] == seg[..., None, :])
        from_start = from_start * (seg == before)
        to_end = to_end * (seg == seg[..., -1:])
        whole = whole * (seg[..., -1] == before[..., 0])

    k_beta = k * beta[..., None]
    # (I + A) with A strictly lower; solve_triangular with unitriangular=True reads only that part.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * from_start[..., None]], dim=-1)
    # Flattened to one batch dimension: torch 2.13's CPU solve is ~100x slower on a 5-D batch.
    solved = torch.linalg.solve_triangular(
        system.reshape(-1, chunk_size, chunk_size),
        rhs.reshape(-1, chunk_size, rhs.shape[-1]),
        upper=False,
        unitriangular=True,
    ).view(rhs.shape)
    u_values, w = solved[..., :dv], solved[..., dv:]  # T diag(beta) V and W
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_in = q * from_start[..., None]
    k_out = k * to_end[..., None]

    state = v.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state
    outputs = []
    for c in range(num_chunks):
        u = u_values[:, :, c] - w[:, :, c] @ state
        outputs.append(q_in[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * whole[:, :, c, None, None] + k_out[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, dv)[:, :, :seq_len]
    return out.transpose(1, 2).to(dtype), state


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution over time: ``out_t = sum_s weight[:, K-1-s] * x_{t-s}``.

    Args:
        x: ``[B, C, S]`` channels first.
        weight: ``[C, 1, K]`` (``nn.Conv1d`` with ``groups=C``).
        segment_ids: Optional ``[B, S]``; inputs from an earlier document count as zero, as
            they would at the start of a row.

    Returns:
        ``[B, C, S]`` (no activation).
    """
    channels, seq_len = x.shape[1], x.shape[-1]
    width = weight.shape[-1]
    if segment_ids is None:
        return F.conv1d(x, weight, padding=width - 1, groups=channels)[..., :seq_len]
    w = weight[:, 0]  # [C, K]
    out = x * w[:, -1:]
    for shift in range(1, min(width, seq_len)):
        same = (segment_ids[:, shift:] == segment_ids[:, :-shift]).to(x.dtype)[:, None]
        shifted = F.pad(x[..., :-shift] * same, (shift, 0))
        out = out + shifted * w[:, width - 1 - shift, None]
    return out


@dataclass
class DeltaNetState:
    """One Gated DeltaNet layer's state between generation forwards (``GatedDeltaNet.state_cache``).

    Attributes:
        conv: ``[B, C, K - 1]`` the conv's last inputs (None before the prompt).
        recurrent: ``[B, Hv, Dk, Dv]`` float32 state of the delta rule (None before the prompt).
        token_mask: ``[B, S_new]`` bool for the coming forward, False on left padding (whose
            inputs are zeroed, so they write nothing); None when every token is real.
    """

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search)."""
        if self.conv is not None and self.recurrent is not None:
            self.conv = self.conv.index_select(0, index)
            self.recurrent = self.recurrent.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes of the conv window and the rule's state."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of the core output, times ``silu(gate)`` (transformers' ``Qwen3NextRMSNormGated``).

    ``weight`` multiplies as usual (ones at init, not zero-centred). The statistics are
    float32; the gate is applied in float32 and the result cast back.
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dtype = x.dtype
        h = x.float()
        if self.fused:
            h = F.rms_norm(h, self._shape, None, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention token mixer, with transformers' parameter names.

    ``in_proj_qkvz`` produces, grouped per key head, that head's q, k and its share of
    the value heads' v and output gate z; ``in_proj_ba`` the per-value-head beta and
    decay-rate inputs. q/k/v go through a depthwise causal conv and SiLU, the decay is
    ``g = -exp(A_log) * softplus(a + dt_bias)``, beta ``sigmoid(b)``; the rule's output
    is normed per value head, gated by ``silu(z)`` and projected back.

    Args:
        hidden_size: Model width.
        num_k_heads: Query/key heads (``linear_num_key_heads``).
        num_v_heads: Value heads (``linear_num_value_heads``), a multiple of ``num_k_heads``.
        head_k_dim: Query/key head size.
        head_v_dim: Value head size.
        conv_kernel_size: Width of the causal conv (``linear_conv_kernel_dim``).
        hidden_act: Activation after the conv (``silu``).
        norm_eps: Epsilon of the gated norm.
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        *,
        conv_kernel_size: int = 4,
        hidden_act: str = "silu",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, conv_kernel_size, groups=conv_dim, padding=conv_kernel_size - 1, bias=False
        )
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        # Decay rates exp(A_log) in [0.01, 16], as transformers draws them (init_full_parameter_ redraws).
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16.0).log_())
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.act_fn = activation(hidden_act)
        # Set by the `gdn_chunk_size` kernel switch (Qwen3NextForCausalLM.configure_kernels).
        self.chunk_size = DEFAULT_CHUNK_SIZE
        # Set by meshforge.parallel.context.apply_cp (ulysses only): the CP plan whose group
        # exchanges heads for sequence (see _mix_ulysses); None without CP.
        self.cp: UlyssesPlan | None = None
        # Set by meshforge.infer.kv_cache during generation: the conv and recurrent state carried
        # from one forward to the next (see _forward_cached); None in training.
        self.state_cache: DeltaNetState | None = None

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Unpack the two projections into q, k ``[B,S,Hk,Dk]``, v, z ``[B,S,Hv,Dv]``, b, a ``[B,S,Hv]``."""
        batch, seq_len, _ = x.shape
        per_group = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(batch, seq_len, self.num_k_heads, -1)
        q, k, v, z = qkvz.split(
            [self.head_k_dim, self.head_k_dim, per_group * self.head_v_dim, per_group * self.head_v_dim],
            dim=-1,
        )
        b, a = self.in_proj_ba(x).view(batch, seq_len, self.num_k_heads, -1).split(per_group, dim=-1)
        v = v.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        z = z.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        return q, k, v, z, b.reshape(batch, seq_len, -1), a.reshape(batch, seq_len, -1)

    def forward(
        self, x: torch.Tensor, segment_ids: torch.Tensor | None = None, cp_mask: object = None
    ) -> torch.Tensor:
        """Mix ``x`` ``[B, S, hidden]`` along time; ``segment_ids`` ``[B, S]`` resets at document starts.

        Padding tokens (segment 0) have their input zeroed first, as transformers does with
        its attention mask, so they write nothing into the state.

        Args:
            x: Normalised hidden states (this rank's slice of each row under CP).
            segment_ids: Document ids of the same tokens, or None.
            cp_mask: Under context parallelism (``cp`` set), the decoder's per-forward
                :class:`~meshforge.parallel.context.CPMask` (full-row document ids, length).
        """
        if self.state_cache is not None:
            return self._forward_cached(x, self.state_cache)
        batch, seq_len, _ = x.shape
        if segment_ids is not None:
            x = x * (segment_ids != 0)[..., None].to(x.dtype)
        q, k, v, z, b, a = self._split(x)
        if self.cp is None:
            out = self._mix(q, k, v, b, a, self.conv1d.weight, self.A_log, self.dt_bias, segment_ids)
        else:
            out = self._mix_ulysses(q, k, v, b, a, cp_mask)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(batch, seq_len, -1))

    def _mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        conv_weight: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        segment_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Conv, activation and the gated delta rule over whole rows: ``[B, S, Hv, Dv]``.

        Head counts come from the shapes (and ``conv_weight``/``a_log``/``dt_bias`` are those
        heads' channels and values): under CP ulysses this runs on a slice of the heads.
        """
        batch, seq_len, k_heads, _ = q.shape
        v_heads = v.shape[2]
        mixed = torch.cat([t.reshape(batch, seq_len, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
        mixed = self.act_fn(causal_conv1d(mixed, conv_weight, segment_ids)).transpose(1, 2)
        key_dim = k_heads * self.head_k_dim
        q, k, v = mixed.split([key_dim, key_dim, v_heads * self.head_v_dim], dim=-1)
        q = q.reshape(batch, seq_len, k_heads, self.head_k_dim)
        k = k.reshape(batch, seq_len, k_heads, self.head_k_dim)
        v = v.reshape(batch, seq_len, v_heads, self.head_v_dim)
        beta = b.sigmoid()
        # float32 decay: exp(A_log) of a low-precision A_log can overflow.
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, segment_ids=segment_ids)

    def _forward_cached(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """The new tokens ``x`` ``[B, S_new, hidden]`` continuing ``state`` (updated in place).

        The conv runs over the cached last ``K - 1`` inputs followed by the new ones (zeros
        before the prompt, as the training forward's left zero padding); the rule is entered
        with the cached state: chunked for a prompt, token by token for one new token (as
        transformers decodes). Left padding is zeroed first and so leaves the state at zero.
        """
        batch, seq_len, _ = x.shape
        if state.token_mask is not None:
            x = x * state.token_mask[..., None].to(x.dtype)
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat([t.reshape(batch, seq_len, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
        weight = self.conv1d.weight
        width = weight.shape[-1]
        before = state.conv if state.conv is not None else mixed.new_zeros(*mixed.shape[:2], width - 1)
        window = torch.cat([before, mixed], dim=-1)
        state.conv = window[..., window.shape[-1] - (width - 1) :]
        mixed = self.act_fn(F.conv1d(window, weight, groups=weight.shape[0])).transpose(1, 2)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        k = k.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        v = v.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if seq_len == 1:
            out, state.recurrent = _recurrent_rule(q, k, v, g, beta, initial_state=state.recurrent)
        else:
            out, state.recurrent = _chunk_rule(
                q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state.recurrent
            )
        out = self.norm(out, z)
        return self.out_proj(out.reshape(batch, seq_len, -1))

    def _mix_ulysses(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        cp_mask: object,
    ) -> torch.Tensor:
        """:meth:`_mix` under CP ulysses: whole rows for a slice of the key-head groups, then back.

        The inputs are all heads of this rank's ``S / u`` tokens. One all-to-all (all
        five tensors packed per key head: q, k, the group's v, b, a) gives every rank
        ``Hk / u`` whole key-head groups over the full row, in global order (ulysses keeps
        contiguous chunks); the conv, the decays and the recurrence then run there with
        those heads' conv channels, ``A_log`` and ``dt_bias`` and the full-row document
        ids, exactly as on one process. A second all-to-all returns ``[B, S / u, Hv, Dv]``.
        Parameters used on a slice get gradient only there; the sum over the CP ranks
        (FSDP over the cp mesh) is the single-process gradient.
        """
        plan = self.cp
        assert plan is not None  # forward calls this only under CP
        if getattr(cp_mask, "seq_len", None) is None:
            raise TypeError(
                "context-parallel Gated DeltaNet needs the CPMask that Qwen3NextModel builds when "
                f"parallelism.context_parallel > 1, got {type(cp_mask).__name__}"
            )
        row = cast(RowMask, cp_mask)  # a CPMask (parallel/'s type, which models/ does not import)
        u = plan.ulysses_size
        batch, local_len, k_heads, _ = q.shape
        v_heads = v.shape[2]
        per_group = v_heads // k_heads
        if k_heads % u or local_len * u != row.seq_len:
            raise ValueError(
                f"context parallel Gated DeltaNet: {k_heads} key heads of {local_len} tokens cannot be "
                f"split over {u} ranks of a {row.seq_len}-token row; model.linear_num_key_heads "
                "must divide by parallelism.context_parallel"
            )
        dv = self.head_v_dim
        packed = torch.cat(
            [
                q,
                k,
                v.reshape(batch, local_len, k_heads, per_group * dv),
                b.reshape(batch, local_len, k_heads, per_group),
                a.reshape(batch, local_len, k_heads, per_group),
            ],
            dim=-1,
        ).transpose(1, 2)
        (full,) = plan.seq_to_heads([packed])  # [B, Hk / u, S, width]
        full = full.transpose(1, 2)
        seq_len, local_k = full.shape[1], k_heads // u
        local_v = local_k * per_group
        dk = self.head_k_dim
        q, k, v, b, a = full.split([dk, dk, per_group * dv, per_group, per_group], dim=-1)
        v = v.reshape(batch, seq_len, local_v, dv)
        b, a = b.reshape(batch, seq_len, local_v), a.reshape(batch, seq_len, local_v)
        rank = plan.rank % u
        # This rank's conv channels: its slice of each of the q, k and v blocks.
        key_dim = k_heads * dk
        qk = torch.arange(rank * local_k * dk, (rank + 1) * local_k * dk, device=q.device)
        vs = torch.arange(rank * local_v * dv, (rank + 1) * local_v * dv, device=q.device)
        channels = torch.cat([qk, qk + key_dim, vs + 2 * key_dim])
        heads = slice(rank * local_v, (rank + 1) * local_v)
        out = self._mix(
            q,
            k,
            v,
            b,
            a,
            self.conv1d.weight.index_select(0, channels),
            self.A_log[heads],
            self.dt_bias[heads],
            row.segments,
        )
        out = plan.heads_to_seq(out.transpose(1, 2))  # [B, Hv, S / u, Dv]
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return (
            f"k_heads={self.num_k_heads}, v_heads={self.num_v_heads}, head_k_dim={self.head_k_dim}, "
            f"head_v_dim={self.head_v_dim}, chunk_size={self.chunk_size}"
        )
