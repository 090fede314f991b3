"""``ContextParallel``: the CP algorithm of one model (per-forward preparation, the attention call)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshforge.models.common.attention import positions_from_segments
from meshforge.parallel.context.blocks import (
    Block,
    FusedRing,
    allowed_mask,
    attend,
    block_update,
    heads_to_seq,
    host_index,
    runs,
    seq_to_heads,
    wait,
)
from meshforge.parallel.context.layout import CPMask, local_token_index, resolve_method

#: Run ring blocks on CPU with the fused flash kernel (``False``: the plain autograd path).
FUSED_CPU_RING = True


class ContextParallel:
    """The CP algorithm of one model: per-forward preparation and the attention call.

    One instance is shared by the decoder (``prepare``) and all its attention modules
    (``__call__``). Construct it through :func:`apply_cp`.

    Args:
        cp_mesh: The 1-D context-parallel mesh.
        method: ``colossal``, ``ulysses``, ``hybrid`` or ``kvallgather``.
        ulysses_degree: Ulysses group size (the CP degree for ulysses, ``1 < u < cp``
            dividing it for hybrid; unused otherwise).
    """

    def __init__(self, cp_mesh: DeviceMesh, method: str, ulysses_degree: int) -> None:
        self.method = resolve_method(method)
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()
        self.ulysses_size = ulysses_degree if self.method in ("ulysses", "hybrid") else 1
        self.ulysses_group = self.group if self.method == "ulysses" else None
        self.ring_size, self.ring_rank, self.ring_group = 1, 0, None
        if self.method == "colossal":
            self.ring_size, self.ring_rank, self.ring_group = self.size, self.rank, self.group
        elif self.method == "hybrid":
            # Ulysses over consecutive CP ranks (rank = ring * u + ulysses), ring across them.
            u = ulysses_degree
            sub = cp_mesh._unflatten(0, (self.size // u, u), ("cp_ring", "cp_ulysses"))
            self.ulysses_group = sub["cp_ulysses"].get_group()
            self.ring_group = sub["cp_ring"].get_group()
            self.ring_size, self.ring_rank = self.size // u, self.rank // u

    def seq_to_heads(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The ulysses all-to-all: ``[B, h, S_local, D]`` each -> ``[B, h / u, u * S_local, D]``.

        Token mixers with their own head exchange (Gated DeltaNet) call it on the plan.
        """
        return seq_to_heads(tensors, self.ulysses_size, self.ulysses_group)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse all-to-all: ``[B, h, u * S_local, D]`` -> ``[B, h * u, S_local, D]``."""
        return heads_to_seq(x, self.ulysses_size, self.ulysses_group)

    # ---- per forward -------------------------------------------------------------------

    def _index(self, seq_len: int, rank: int, device: torch.device) -> torch.Tensor:
        return host_index(lambda: local_token_index(seq_len, self.size, rank, method=self.method).to(device))

    def prepare(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
    ) -> tuple[CPMask, torch.Tensor]:
        """Build this forward's :class:`CPMask` and the local tokens' global positions.

        Args:
            input_ids: This rank's tokens ``[B, S_local]``; only its shape and device are
                read (a pipeline stage passes a ``[B, S_local]`` view of its hidden states).
            position_ids: Their positions, or None to derive them (global positions,
                restarting per document when ``segment_ids`` are given).
            segment_ids: This rank's slice of the document ids, or None.

        Returns:
            ``(mask, position_ids)``.
        """
        device = input_ids.device
        seq_len = input_ids.shape[-1] * self.size
        q_index = self._index(seq_len, self.rank, device)
        segments = None
        if segment_ids is not None:
            gathered = wait(funcol.all_gather_single(segment_ids.contiguous(), 1, self.group))
            order = torch.cat([self._index(seq_len, r, device) for r in range(self.size)])
            segments = torch.empty_like(gathered)
            segments[:, order] = gathered
        if position_ids is None:
            if segments is not None:
                position_ids = positions_from_segments(segments).index_select(1, q_index)
            else:
                position_ids = q_index.expand(input_ids.shape[0], -1)
        return CPMask(q_index=q_index, seq_len=seq_len, segments=segments), position_ids

    # ---- attention ---------------------------------------------------------------------

    # Compiled decoder layers (kernels.compile) trace ulysses (two all-to-alls around the
    # single-device attention) and kvallgather (one all-gather) whole, all shapes static; the
    # ring steps (colossal, hybrid) run eagerly: their block plan is Python data (runs of
    # positions, skipped blocks, a hand-written backward ring) that dynamo would break on.
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        *,
        scale: float,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attention output for the local queries ``[B, H, S_local, Dv]``.

        Args:
            q: This rank's queries ``[B, H, S_local, D]``.
            k: Its keys ``[B, Hkv, S_local, D]`` (``H`` a multiple of ``Hkv``).
            v: Its values ``[B, Hkv, S_local, Dv]``; ``Dv`` may differ from ``D`` (MLA).
            mask: The :class:`CPMask` the decoder built for this forward.
            scale: Multiplier of ``q k^T``.
            sinks: Per-head sink logits ``[H]`` (gpt-oss): one extra logit per head joins
                every query's softmax; None for plain softmax attention.
            window: Sliding window: key j visible from query i only when
                ``i - window < j <= i`` (global positions); None for full causal attention.
        """
        if not isinstance(mask, CPMask):
            raise TypeError(
                "context-parallel attention needs the CPMask that DecoderModel builds when "
                f"parallelism.context_parallel > 1, got {type(mask).__name__}"
            )
        # Every exchange moves q/k/v blocks of one head size (K and V travel stacked), so
        # unequal sizes (MLA: qk = nope + rope, v narrower) are zero-padded to the larger:
        # zero value columns give zero output columns (cut again below), and zero q/k
        # columns add nothing to the scores (the scale is explicit).
        v_dim, qk_dim = v.shape[-1], q.shape[-1]
        if v_dim < qk_dim:
            v = F.pad(v, (0, qk_dim - v_dim))
        elif v_dim > qk_dim:
            q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
        if self.method == "kvallgather":
            out = self._kv_allgather(q, k, v, mask, scale, sinks, window)
        elif self.method == "colossal":
            index_of = lambda r: self._index(mask.seq_len, r, q.device)  # noqa: E731
            out = self._ring(q, k, v, mask.q_index, index_of, mask, scale, sinks, window, tag="colossal")
        else:
            out = self._ulysses(q, k, v, mask, scale, sinks, window)
        return out[..., :v_dim] if out.shape[-1] != v_dim else out

    def _kv_allgather(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: CPMask,
        scale: float,
        sinks: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        full = funcol.all_gather_single_autograd(torch.stack([k, v]), 3, self.group)
        # Keys after this rank's last query are never visible, nor (sliding window) those
        # before its first query's window: leave them out of the product. The rank holds the
        # rank-th of `size` contiguous chunks, so its first and last positions are known on
        # the host (no sync, and a compiled layer keeps them static).
        first = self.rank * (mask.seq_len // self.size)
        stop = first + mask.seq_len // self.size
        start = 0 if window is None else max(0, first - window + 1)
        key = ("kvallgather", window)
        if torch.compiler.is_compiling() or key not in mask.cache:
            # Compiled: built in the graph (see `_ulysses_mask`).
            keys = torch.arange(start, stop, device=q.device)
            allowed = allowed_mask(mask.q_index, keys, mask.segments, True, window)
            if torch.compiler.is_compiling():
                return attend(q, full[0][:, :, start:stop], full[1][:, :, start:stop], allowed, scale, sinks)
            mask.cache[key] = allowed
        return attend(q, full[0][:, :, start:stop], full[1][:, :, start:stop], mask.cache[key], scale, sinks)

    def _ulysses(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: CPMask,
        scale: float,
        sinks: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        u = self.ulysses_size
        heads = q.shape[1]
        if heads % u:
            raise ValueError(
                f"parallelism.context_parallel: ulysses splits the {heads} attention heads of a rank over "
                f"{u} ranks; the head count must divide by {u}"
            )
        kv_heads = k.shape[1]
        if kv_heads % u:
            # Each rank needs whole K/V heads for its query heads: repeat each K/V head so
            # the count divides u (query head h still reads K/V head h // group size).
            repeat = u // math.gcd(kv_heads, u)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if sinks is not None:
            # After the all-to-all this rank holds the u-th slice of the heads its ulysses
            # position names (rank = ring * u + ulysses): the sinks of those heads.
            sinks = sinks.view(u, heads // u)[self.rank % u]
        q, k, v = seq_to_heads([q, k, v], u, self.ulysses_group)
        if self.method == "ulysses":
            # Whole sequence in order: the single-process attention and masks, unchanged.
            out = attend(q, k, v, self._ulysses_mask(mask, window, q.device), scale, sinks)
        else:
            out = self._hybrid_ring(q, k, v, mask, scale, sinks, window)
        return heads_to_seq(out, u, self.ulysses_group)

    def _ulysses_mask(self, mask: CPMask, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The whole-row mask ulysses attends with (None: plain causal), shared by the layers.

        A compiled layer builds it in its graph instead: reading the per-forward cache would make
        the first layer's graph (empty cache) differ from the others' (filled), a recompile.
        """
        if mask.segments is None and window is None:
            return None
        key = ("ulysses", window)
        if torch.compiler.is_compiling() or key not in mask.cache:
            everything = torch.arange(mask.seq_len, device=device)
            allowed = allowed_mask(everything, everything, mask.segments, True, window)
            if torch.compiler.is_compiling():
                return allowed
            mask.cache[key] = allowed
        return mask.cache[key]

    def _group_index(self, seq_len: int, ring_rank: int, device: torch.device) -> torch.Tensor:
        """Positions a ulysses group holds after its all-to-all, in gathered (member) order."""
        u = self.ulysses_size
        return host_index(
            lambda: torch.cat([self._index(seq_len, ring_rank * u + j, device) for j in range(u)])
        )

    @torch.compiler.disable
    def _hybrid_ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: CPMask,
        scale: float,
        sinks: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        gathered = self._group_index(mask.seq_len, self.ring_rank, q.device)
        order = host_index(lambda: torch.argsort(gathered))
        gathered_sorted = host_index(lambda: gathered[order])
        # Sorted, a group's positions are two contiguous chunks (the coarse ring layout).
        q, k, v = (x.index_select(2, order) for x in (q, k, v))

        def kv_index(ring_rank: int) -> torch.Tensor:
            return host_index(lambda: self._group_index(mask.seq_len, ring_rank, q.device).sort().values)

        out = self._ring(q, k, v, gathered_sorted, kv_index, mask, scale, sinks, window, tag="hybrid")
        return out.index_select(2, torch.argsort(order))

    def _ring_shift(self, x: torch.Tensor) -> torch.Tensor:
        """Send ``x`` to the next ring rank and receive the previous one's (one permutation all-to-all)."""
        n, r = self.ring_size, self.ring_rank
        send, recv = [0] * n, [0] * n
        send[(r + 1) % n] = recv[(r - 1) % n] = x.shape[0]
        # Only the ring methods (colossal, hybrid) shift, and they set the ring group.
        assert self.ring_group is not None
        return funcol.all_to_all_single_autograd(x, recv, send, self.ring_group)

    def _ring_plan(
        self, q_index: torch.Tensor, kv_index_of, mask: CPMask, window: int | None, tag: str
    ) -> list[list[Block]]:
        """Per ring step, the (query run, key run) blocks to compute, fully masked ones left out.

        Built once per forward and window (cached in ``mask.cache`` under ``tag``) and
        shared by the layers: the block structure depends only on the positions, the
        documents and the window.
        """
        key = (tag, window, "plan")
        if key in mask.cache:
            return mask.cache[key]
        q_runs = runs(q_index)
        plan: list[list[Block]] = []
        for step in range(self.ring_size):
            k_index = kv_index_of((self.ring_rank - step) % self.ring_size)
            blocks = []
            for q_off, q_start, q_n in q_runs:
                for k_off, k_start, k_n in runs(k_index):
                    if k_start > q_start + q_n - 1:
                        continue  # every key of the chunk lies after every query: fully masked
                    if window is not None and k_start + k_n - 1 <= q_start - window:
                        continue  # every key lies before every query's window
                    causal = k_start + k_n - 1 > q_start  # else every key precedes every query
                    # Does the window cut anything out of this block? (The farthest pair.)
                    cut = window if window is not None and q_start + q_n - 1 - k_start >= window else None
                    allowed = allowed_mask(
                        q_index[q_off : q_off + q_n], k_index[k_off : k_off + k_n], mask.segments, causal, cut
                    )
                    # The same chunk on both sides, no documents, no window cut: the kernel's own causal mask.
                    same = (
                        causal and mask.segments is None and cut is None and (q_start, q_n) == (k_start, k_n)
                    )
                    blocks.append(Block(q_off, q_n, k_off, k_n, allowed, same))
            plan.append(blocks)
        mask.cache[key] = plan
        return plan

    @torch.compiler.disable
    def _ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_index: torch.Tensor,
        kv_index_of,
        mask: CPMask,
        scale: float,
        sinks: torch.Tensor | None,
        window: int | None,
        *,
        tag: str,
    ) -> torch.Tensor:
        """Ring attention of ``q`` (positions ``q_index``) over every ring rank's K/V block.

        ``kv_index_of(ring_rank)`` gives the positions of that rank's K/V; ``tag`` names
        the caller in the per-forward mask cache. On CPU the blocks run PyTorch's fused
        flash kernel inside one autograd function (forward and backward rings written
        out); elsewhere plain tensor operations under autograd. Sinks join once, after
        the last block: the softmax denominator gains ``exp(sink)``.
        """
        plan = self._ring_plan(q_index, kv_index_of, mask, window, tag)
        if q.device.type == "cpu" and FUSED_CPU_RING:
            return FusedRing.apply(q, k, v, sinks, self, plan, scale)
        batch, heads, q_len, dim = q.shape
        kv_heads = k.shape[1]
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, q_len, dim)
        states: dict[int, Any] = {}
        kv = torch.stack([k, v])
        for step, blocks in enumerate(plan):
            # Issue the next exchange first so it travels while this block is computed.
            incoming = self._ring_shift(kv) if step < self.ring_size - 1 else None
            for b in blocks:
                states[b.q_off] = block_update(
                    states.get(b.q_off),
                    grouped[..., b.q_off : b.q_off + b.q_n, :],
                    kv[0][:, :, b.k_off : b.k_off + b.k_n],
                    kv[1][:, :, b.k_off : b.k_off + b.k_n],
                    b.allowed,
                    scale,
                )
            if incoming is not None:
                kv = incoming
        parts = []
        for _, (run_max, total, acc) in sorted(states.items()):
            if sinks is not None:
                # The sink is one more logit of the row: fold it into the running pair.
                sink = sinks.float().view(1, kv_heads, heads // kv_heads, 1)
                new_max = torch.maximum(run_max, sink.detach())
                rescale = torch.exp(run_max - new_max)
                total = total * rescale + torch.exp(sink - new_max)
                acc = acc * rescale.unsqueeze(-1)
            parts.append(acc / total.unsqueeze(-1))
        return torch.cat(parts, dim=-2).reshape(batch, heads, q_len, dim).to(q.dtype)


__all__ = ["FUSED_CPU_RING", "ContextParallel"]
