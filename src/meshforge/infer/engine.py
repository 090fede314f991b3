"""meshforge's own decoder loop for the built-in families: left-padded batches, KV cache, greedy or sampled.

The loop reproduces what transformers' ``generate`` does for a left-padded batch, so greedy tokens
are the same on the same weights: positions count real tokens only (``cumsum(mask) - 1``, padding
never attended), a finished row (an eos token) keeps receiving the pad token until every row is done,
and the eos token itself is part of the completion. With the cache (``KVCache``) the prompt is run
once and each step feeds one token per row; without it every step runs the whole sequence through
the training forward (packed-document mask: padding is segment 0, real tokens segment 1).
:class:`Stepper` holds those forwards for one batch, so beam search (``beam.py``) runs on the same
ones and only adds the reordering of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshforge.infer.kv_cache import KVCache
from meshforge.infer.sampling import SamplingOptions, next_tokens

StopCheck = Callable[[list[int]], bool]


@dataclass(frozen=True)
class DecodeRequest:
    """One batch to complete.

    Attributes:
        prompts: Token ids of each prompt (unpadded).
        max_new_tokens: Most tokens generated per row.
        pad_token_id: Fills the left padding and the rows that finished.
        eos_token_ids: Tokens that end a row (kept in its completion).
        use_kv_cache: Cache keys and values (false: recompute the sequence every step).
        compressed_mla: Cache MLA's latent instead of per-head keys/values (deepseek_v3).
    """

    prompts: Sequence[Sequence[int]]
    max_new_tokens: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    use_kv_cache: bool = True
    compressed_mla: bool = True


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, S]`` with every prompt right-aligned."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, length - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, length - len(prompt) :] = True
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # As transformers: count real tokens; padding gets position 1 (never attended anyway).
    return (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)


class Stepper:
    """The forwards of one batch: the prompt, then one token per row, with or without the cache.

    Args:
        model: The causal LM (eval mode, on its device).
        ids: ``[B, S]`` left-padded prompts.
        mask: ``[B, S]`` bool, False on padding.
        request: Limits and the cache choice.
    """

    def __init__(
        self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, request: DecodeRequest
    ) -> None:
        self.model = model
        head = model.lm_head
        assert isinstance(head, nn.Module)
        self.head = head
        self.sequences, self.full_mask = ids, mask
        self.cache = (
            KVCache(mask, ids.shape[1] + request.max_new_tokens, compressed_mla=request.compressed_mla)
            if request.use_kv_cache
            else None
        )
        self._feed, self._feed_pos = ids, _positions(mask)

    def logits(self) -> torch.Tensor:
        """Next-token logits ``[B, vocab]`` of every row (the pending tokens are run first)."""
        if self.cache is not None:
            with self.cache.attached(self.model):
                hidden = self.model(self._feed, self._feed_pos, return_hidden=True)
            self.cache.advance(self._feed.shape[1])
        else:
            hidden = self.model(
                self.sequences, _positions(self.full_mask), self.full_mask.long(), return_hidden=True
            )
        # The head on the last position only (as transformers' logits_to_keep=1): a prompt's other
        # positions would cost a [S, vocab] matmul for nothing. Under FSDP the root's parameters
        # (the head among them) stay unsharded after the forward.
        return self.head(hidden[:, -1])

    def append(self, token: torch.Tensor) -> None:
        """Add one token per row ``[B]`` (run by the next :meth:`logits`)."""
        self.sequences = torch.cat([self.sequences, token[:, None]], dim=1)
        self.full_mask = torch.cat([self.full_mask, torch.ones_like(self.full_mask[:, :1])], dim=1)
        if self.cache is not None:
            self.cache.valid[:, self.cache.length] = True
        self._feed, self._feed_pos = token[:, None], _positions(self.full_mask)[:, -1:]

    def reorder(self, index: torch.Tensor) -> None:
        """Rows continue the rows ``index`` names (beam search), cache included."""
        self.sequences = self.sequences.index_select(0, index)
        self.full_mask = self.full_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


@torch.no_grad()
def decode(
    model: nn.Module,
    request: DecodeRequest,
    options: SamplingOptions,
    *,
    generator: torch.Generator | None = None,
    stop: StopCheck | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Generate completions for one batch on a built-in model (``cache_support(model)`` is None).

    Args:
        model: The causal LM, in eval mode, on its device (FSDP-sharded or not).
        request: Prompts and limits.
        options: Greedy or sampling settings.
        generator: Sampling generator (seeded by the caller).
        stop: Called with a row's generated tokens after each step; True ends the row (stop strings).
        on_token: Called with the step index after each step (progress).

    Returns:
        The generated token ids of each row, up to and including its eos token.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(request.prompts, request.pad_token_id, device)
    batch = ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    eos = torch.tensor(request.eos_token_ids or (-1,), device=device)
    generated: list[list[int]] = [[] for _ in range(batch)]
    stepper = Stepper(model, ids, mask, request)
    for step in range(request.max_new_tokens):
        logits = stepper.logits()
        token = next_tokens(logits, stepper.sequences, options, generator)
        token = torch.where(done, torch.full_like(token, request.pad_token_id), token)
        for row in (~done).nonzero().flatten().tolist():
            generated[row].append(int(token[row]))
        done |= torch.isin(token, eos)
        if stop is not None:
            for row in (~done).nonzero().flatten().tolist():
                if stop(generated[row]):
                    done[row] = True
        stepper.append(token)
        if on_token is not None:
            on_token(step)
        if bool(done.all()):
            break
    return generated
