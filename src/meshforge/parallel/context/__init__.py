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
positions); a family whose attention is no module class of its own switches the model itself
(``FamilySpec.cp_apply``: the transformers path registers the plan as an attention
implementation, ``models/generic/cp.py``); ``shard_batch_for_cp`` gives each rank its tokens. No
extra model keyword is needed (``CP_MODEL_KWARGS`` is empty). Modules: ``layout.py`` (method
names, token layout, batch sharding, ``CPMask``), ``plan.py`` (``ContextParallel``), ``blocks.py``
(the per-block masks and kernels, the fused CPU ring and the ulysses all-to-alls), ``apply.py``
(``apply_cp``).
"""

from meshforge.parallel.context.apply import apply_cp
from meshforge.parallel.context.layout import (
    CP_METHODS,
    CP_MODEL_KWARGS,
    CPMask,
    local_token_index,
    num_sequence_chunks,
    resolve_method,
    shard_batch_for_cp,
    unshard_sequence,
)
from meshforge.parallel.context.plan import ContextParallel

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
