"""Context parallelism (CP): every rank holds a slice of each sequence; attention trades K/V or heads.

PyTorch's experimental ``context_parallel`` has no CPU SDPA sharding rule, so this is our
own implementation on the autograd-aware functional collectives
(``all_to_all_single_autograd``, ``all_gather_single_autograd``): gradients flow back
through every exchange, and the model code stays single-device. Only the attention call
and the per-forward mask change; everything else in a decoder layer is per-token.

Methods (``parallelism.context_parallel_method``; MindSpeed's ``cp_type`` maps onto them):

* ``ulysses``: an all-to-all turns "all heads, 1/cp of the sequence" into "1/cp of the
  heads, the whole sequence"; plain SDPA runs on that; a second all-to-all turns it back.
  K/V heads fewer than the CP degree are repeated first so each rank gets whole groups.
* ``colossal`` (``ring``): K/V blocks travel around the ring in cp - 1 steps (each step one
  ``all_to_all_single`` permutation, issued before the step's compute so they overlap);
  each block is attended with a running max / sum (flash-attention style) and merged.
  The sequence is cut into 2 * cp chunks and rank r keeps chunks r and 2cp-1-r
  (load-balanced causal layout), so after the diagonal step every rank computes half
  a block: the query/key chunk pairs that causality masks out entirely are skipped.
  On CPU each block runs PyTorch's fused flash kernel (``FusedRing``: output and
  log-sum-exp per block forward, the kernel's backward with the final log-sum-exp and
  the K/V gradients travelling the ring back to their owners); elsewhere (or with
  ``FUSED_CPU_RING = False``) the same blocks run as plain tensor operations under autograd.
* ``kvallgather``: K/V of the whole sequence are all-gathered; local queries attend with
  their global causal offsets (keys after the rank's last query, or before its first
  query's sliding window, are left out).
* ``hybrid``: ulysses inside groups of ``ulysses_degree_in_cp`` consecutive CP ranks, ring
  across the groups. It uses the colossal batch layout: a ulysses group's ranks then
  hold, together, exactly the two chunks a ring rank of the coarser ring would hold.

Packed documents (``segment_ids``) are respected by all methods: each forward gathers
the full row's document ids once (a tiny integer all-gather) and every query/key block
is masked block-diagonally by document, exactly as the single-process mask does.

Families: each family's spec names the modules CP switches (``FamilySpec.cp_modules``) and
the methods it runs (``cp_methods``, None = all). The grouped-query ``Attention`` families
(qwen3, llama, qwen3_moe), deepseek_v3 and gpt_oss run every method:

* deepseek_v3's multi-head latent attention has q/k heads of ``nope + rope`` dims and
  values of ``v_head_dim``; the narrower side is zero-padded before the exchanges and
  cut from the output (exact: zero value columns give zero outputs, zero q/k columns
  add nothing to a score). Its interleaved RoPE reads the global positions.
* gpt_oss adds per-head sinks (one logit per head joins every softmax) and sliding
  windows. Ulysses and kvallgather run its single-device explicit softmax on the head
  slice (the sinks of the rank's heads) or the gathered keys; the ring folds the sink in
  once after the last block (the denominator gains ``exp(sink)``, i.e. ``out *
  sigmoid(lse - sink)``). Windows mask key j from query i unless ``i - window < j <= i``
  in global positions, so they reach across the ranks' chunk boundaries; ring blocks
  entirely outside a window are skipped like the causally dead ones.
* qwen3_next runs ulysses only (its spec's ``cp_methods``, the reference's only method for
  it): its gated attention layers take the plan like any ``Attention``; its Gated
  DeltaNet layers (``cp`` set too) trade sequence for whole key-head groups with their
  own all-to-alls, so the conv and the recurrence run over the whole row per head
  (``GatedDeltaNet._mix_ulysses``). The ring methods cannot hand the recurrent state
  over between the ranks' slices and are refused.

Attention dropout stays refused under CP (each attention module raises).

Seams: ``apply_cp`` sets ``cp`` on every attention module of the spec's ``CPModules``
(``Attention``, ``MultiHeadLatentAttention``, ``SinkAttention``: the callable that replaces
their single-device attention), on its token mixers (Gated DeltaNet: it calls the plan's
``seq_to_heads``/``heads_to_seq``) and on the inner model (``DecoderModel``, gpt_oss'
``GptOssModel``: its ``prepare`` builds the per-forward :class:`CPMask` and global
positions); ``shard_batch_for_cp`` gives each rank its tokens. No extra model keyword
is needed (``CP_MODEL_KWARGS`` is empty). The per-block masks and kernels, the fused
CPU ring and the ulysses all-to-alls live in :mod:`meshforge.parallel.context_blocks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshforge.models.common.attention import positions_from_segments
from meshforge.models.spec import is_generic_model
from meshforge.parallel.context_blocks import (
    Block,
    FusedRing,
    allowed_mask,
    attend,
    block_update,
    heads_to_seq,
    runs,
    seq_to_heads,
    wait,
)

CP_METHODS: tuple[str, ...] = ("colossal", "ulysses", "hybrid", "kvallgather")
#: Extra keys ``shard_batch_for_cp`` adds that the trainer passes to the model: none, the
#: attention gathers what it needs about the full row itself (see ``ContextParallel.prepare``).
CP_MODEL_KWARGS: tuple[str, ...] = ()
_ALIASES = {"ring": "colossal"}


def resolve_method(method: str) -> str:
    """The CP method name with aliases resolved (``ring`` -> ``colossal``).

    Raises:
        ValueError: For an unknown name, listing the valid ones.
    """
    name = _ALIASES.get(method, method)
    if name not in CP_METHODS:
        raise ValueError(
            f"parallelism.context_parallel_method: unknown {method!r}; valid: colossal (alias ring), "
            "ulysses, hybrid, kvallgather"
        )
    return name


def num_sequence_chunks(method: str, cp: int) -> int:
    """How many equal chunks a sequence is cut into: 2 * cp for the load-balanced layout, else cp."""
    return 2 * cp if resolve_method(method) in ("colossal", "hybrid") else cp


def local_token_index(seq_len: int, cp: int, rank: int, *, method: str) -> torch.Tensor:
    """Global sequence positions of the tokens CP rank ``rank`` keeps, in its local order.

    Args:
        seq_len: Full sequence length.
        cp: CP degree.
        rank: This rank's index in the CP mesh.
        method: CP method; colossal and hybrid keep chunks ``rank`` and ``2cp-1-rank``
            of ``2cp``, ulysses and kvallgather the ``rank``-th of ``cp`` contiguous chunks.

    Returns:
        A CPU LongTensor ``[seq_len // cp]``.

    Raises:
        ValueError: If ``seq_len`` does not divide into the chunks the method needs.
    """
    method = resolve_method(method)
    chunks = num_sequence_chunks(method, cp)
    if seq_len % chunks:
        why = "2 * context_parallel, the load-balanced causal layout" if chunks == 2 * cp else "one per rank"
        raise ValueError(
            f"parallelism.context_parallel: {cp} with context_parallel_method {method} cuts each sequence "
            f"into {chunks} equal chunks ({why}), but the data's seq length is {seq_len}; use a seq_length "
            f"that is a multiple of {chunks}"
        )
    size = seq_len // chunks
    first = torch.arange(rank * size, (rank + 1) * size)
    if chunks == cp:
        return first
    mirror = chunks - 1 - rank
    return torch.cat([first, torch.arange(mirror * size, (mirror + 1) * size)])


def shard_batch_for_cp(
    batch: dict[str, torch.Tensor], cp_mesh: DeviceMesh, *, method: str
) -> dict[str, torch.Tensor]:
    """This CP rank's part of every ``[B, S, ...]`` tensor of a micro-batch.

    ``position_ids`` are made explicit from the full row before slicing (global positions,
    restarting per document when ``segment_ids`` are given), so RoPE sees the positions a
    single process would. Other values (and tensors without the sequence dimension) pass
    through unchanged.

    Args:
        batch: ``input_ids``, ``labels`` and optional ``position_ids``/``segment_ids``, ``[B, S]``.
        cp_mesh: The 1-D context-parallel mesh.
        method: CP method (decides the layout).

    Returns:
        A new dict with ``[B, S // cp]`` tensors.

    Raises:
        ValueError: If the sequence length does not divide into the method's chunks.
    """
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[-1]
    index = local_token_index(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), method=method)
    index = index.to(input_ids.device)
    out = dict(batch)
    if out.get("position_ids") is None:
        segments = batch.get("segment_ids")
        if segments is not None:
            out["position_ids"] = positions_from_segments(segments)
        else:
            out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            out[key] = value.index_select(1, index)
    return out


def unshard_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, *, method: str, dim: int = 1) -> torch.Tensor:
    """Gather the CP ranks' slices of ``x`` along ``dim`` back into full sequence order (autograd-aware)."""
    cp = cp_mesh.size()
    local = x.shape[dim]
    gathered = funcol.all_gather_single_autograd(x.contiguous(), dim, cp_mesh.get_group())
    order = torch.cat([local_token_index(local * cp, cp, r, method=method) for r in range(cp)])
    return gathered.index_select(dim, torch.argsort(order).to(x.device))


@dataclass
class CPMask:
    """What every attention layer of one forward needs about the full rows.

    Built once per forward by ``ContextParallel.prepare`` and passed to the layers in
    place of the ``[B, 1, S, S]`` mask.

    Attributes:
        q_index: Global positions of this rank's tokens ``[S_local]``.
        seq_len: Full sequence length.
        segments: Full-row document ids ``[B, S]`` in global order, or None (plain causal).
        cache: Masks derived from the above, shared by the layers of this forward.
    """

    q_index: torch.Tensor
    seq_len: int
    segments: torch.Tensor | None
    cache: dict[Any, Any] = field(default_factory=dict)

    def narrow_rows(self, start: int, stop: int) -> CPMask:
        """This mask for batch rows ``start:stop`` (chunked micro-batches run layers on row slices).

        Only ``segments`` is per row; the derived masks in ``cache`` hold a row dimension too, so
        the slice gets a cache of its own. The slice is kept in this mask's cache, so every layer
        of the forward shares one per row range (and, through it, the masks it derives). Without
        documents nothing is per row and the mask itself is returned.

        Raises:
            ValueError: ``start:stop`` is not a non-empty range of the mask's rows.
        """
        if self.segments is None:
            return self
        rows = self.segments.shape[0]
        if not 0 <= start < stop <= rows:
            raise ValueError(f"CPMask.narrow_rows: rows {start}:{stop} of a {rows}-row batch")
        if (start, stop) == (0, rows):
            return self
        key = ("rows", start, stop)
        if key not in self.cache:
            self.cache[key] = CPMask(self.q_index, self.seq_len, self.segments[start:stop])
        return self.cache[key]

    def narrow_batch(self, dim: int, start: int, stop: int) -> CPMask:
        """``narrow_rows`` for :mod:`meshforge.parallel.chunk_batch` (objects with this method are sliced).

        Raises:
            ValueError: ``dim`` is not 0 (the mask's rows are the hidden states' dim 0).
        """
        if dim != 0:
            raise ValueError(
                f"parallelism.chunk_mbs_batch_dim: {dim}; under context parallelism the decoder layers' "
                "batch dimension is 0 (the per-row document ids of the CP mask), use 0"
            )
        return self.narrow_rows(start, stop)


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
        return local_token_index(seq_len, self.size, rank, method=self.method).to(device)

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

    # Compiled decoder layers (kernels.compile) run this eagerly: its block plan is Python
    # data (runs, per-forward mask cache) that dynamo would otherwise re-trace or break on.
    @torch.compiler.disable
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
        # before its first query's window: leave them out of the product.
        stop = int(mask.q_index[-1]) + 1
        start = 0 if window is None else max(0, int(mask.q_index[0]) - window + 1)
        key = ("kvallgather", window)
        if key not in mask.cache:
            keys = torch.arange(start, stop, device=q.device)
            mask.cache[key] = allowed_mask(mask.q_index, keys, mask.segments, True, window)
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
            key = ("ulysses", window)
            if key not in mask.cache:
                plain = mask.segments is None and window is None
                everything = torch.arange(mask.seq_len, device=q.device)
                mask.cache[key] = (
                    None if plain else allowed_mask(everything, everything, mask.segments, True, window)
                )
            out = attend(q, k, v, mask.cache[key], scale, sinks)
        else:
            out = self._hybrid_ring(q, k, v, mask, scale, sinks, window)
        return heads_to_seq(out, u, self.ulysses_group)

    def _group_index(self, seq_len: int, ring_rank: int, device: torch.device) -> torch.Tensor:
        """Positions a ulysses group holds after its all-to-all, in gathered (member) order."""
        u = self.ulysses_size
        return torch.cat([self._index(seq_len, ring_rank * u + j, device) for j in range(u)])

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
        order = torch.argsort(gathered)
        # Sorted, a group's positions are two contiguous chunks (the coarse ring layout).
        q, k, v = (x.index_select(2, order) for x in (q, k, v))

        def kv_index(ring_rank: int) -> torch.Tensor:
            return self._group_index(mask.seq_len, ring_rank, q.device).sort().values

        out = self._ring(q, k, v, gathered[order], kv_index, mask, scale, sinks, window, tag="hybrid")
        return out.index_select(2, torch.argsort(order))

    def _ring_shift(self, x: torch.Tensor) -> torch.Tensor:
        """Send ``x`` to the next ring rank and receive the previous one's (one permutation all-to-all)."""
        n, r = self.ring_size, self.ring_rank
        send, recv = [0] * n, [0] * n
        send[(r + 1) % n] = recv[(r - 1) % n] = x.shape[0]
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


#: Run ring blocks on CPU with the fused flash kernel (``False``: the plain autograd path).
FUSED_CPU_RING = True


def _ulysses_size(cp_mesh: DeviceMesh, method: str, ulysses_degree: int | None) -> int:
    """The ulysses group size of ``method`` (1 for the ring methods), validated against the mesh."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp: expects the 1-D cp mesh, got {cp_mesh.ndim} dims")
    size = cp_mesh.size()
    if method == "ulysses":
        if ulysses_degree not in (None, size):
            raise ValueError(
                f"parallelism.ulysses_degree_in_cp: ulysses CP requires it to equal context_parallel ({size}), "
                f"got {ulysses_degree}"
            )
        return size
    if method == "hybrid":
        if ulysses_degree is None or not 1 < ulysses_degree < size or size % ulysses_degree:
            raise ValueError(
                "parallelism.ulysses_degree_in_cp: hybrid CP requires 1 < ulysses_degree_in_cp < "
                f"context_parallel ({size}) dividing it, got {ulysses_degree}"
            )
        return ulysses_degree
    return 1


def apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, *, method: str, ulysses_degree: int | None = None
) -> None:
    """Switch every attention module of ``model`` to the context-parallel algorithm, in place.

    Works on the meta device (only attributes change). The batch must then be cut with
    :func:`shard_batch_for_cp` using the same ``method``.

    Args:
        model: A built-in causal LM whose family spec gives CP modules (``FamilySpec.cp_modules``,
            limited to ``cp_methods``), or a transformers model on the generic path
            (:mod:`meshforge.parallel.context_generic`).
        cp_mesh: The 1-D context-parallel mesh (every CP rank calls this: hybrid creates
            sub-groups).
        method: ``colossal`` (alias ``ring``), ``ulysses``, ``hybrid`` or ``kvallgather``.
        ulysses_degree: ``parallelism.ulysses_degree_in_cp``: for ulysses None or the CP
            degree; for hybrid ``1 < u < cp`` dividing cp.

    Raises:
        NotImplementedError: For a model without CP modules, or a method its family refuses
            (the spec's ``cp_refusal`` says why).
        ValueError: For a bad method, ulysses degree or head count.
    """
    method = resolve_method(method)
    if is_generic_model(model):
        # The generic transformers path: the plan runs as the model's attention implementation.
        from meshforge.parallel.context_generic import apply_generic_cp

        u = _ulysses_size(cp_mesh, method, ulysses_degree)
        apply_generic_cp(model, ContextParallel(cp_mesh, method, u))
        return
    from meshforge.models.registry import built_families, spec_of_model

    spec = spec_of_model(model)
    family = spec.name if spec is not None else type(model).__name__
    if spec is not None and spec.cp_methods is not None and method not in spec.cp_methods:
        raise NotImplementedError(
            f"not supported yet: parallelism.context_parallel > 1 for {family}: context_parallel_method "
            f"{method}: {spec.cp_refusal}"
        )
    targets = spec.cp_modules() if spec is not None and spec.cp_modules is not None else None
    decoders = [m for m in model.modules() if targets and isinstance(m, targets.decoders)]
    attentions = [m for m in model.modules() if targets and isinstance(m, targets.attentions)]
    # Token mixers with their own head exchange (qwen3_next's Gated DeltaNet, ulysses only).
    mixers = [m for m in model.modules() if targets and targets.mixers and isinstance(m, targets.mixers)]
    if not decoders or not (attentions or mixers):
        raise NotImplementedError(
            f"not supported yet: parallelism.context_parallel > 1 for {family} (CP runs on the built-in "
            f"families {', '.join(built_families())} and the generic transformers path)"
        )
    u = _ulysses_size(cp_mesh, method, ulysses_degree)
    for attn in attentions:
        if attn.num_heads % u:
            raise ValueError(
                f"parallelism.context_parallel: {method} splits the {attn.num_heads} attention heads over "
                f"{u} ranks; num_attention_heads must divide by {u}"
            )
    for mixer in mixers:
        # Whole key-head groups per rank (value heads are a multiple of key heads, so they follow).
        if mixer.num_k_heads % u:
            raise ValueError(
                f"parallelism.context_parallel: ulysses splits the {mixer.num_k_heads} Gated DeltaNet key heads "
                f"(per tensor-parallel rank) over {u} ranks; model.linear_num_key_heads must divide by {u} "
                "(model.linear_num_value_heads, a multiple of it, then does too)"
            )
    plan = ContextParallel(cp_mesh, method, u)
    for module in (*decoders, *attentions, *mixers):
        module.cp = plan


__all__ = [
    "CPMask",
    "CP_METHODS",
    "CP_MODEL_KWARGS",
    "ContextParallel",
    "apply_cp",
    "local_token_index",
    "num_sequence_chunks",
    "resolve_method",
    "shard_batch_for_cp",
    "unshard_sequence",
]
