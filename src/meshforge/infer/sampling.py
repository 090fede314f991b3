"""Choosing the next token from logits: penalties, temperature, top-k / top-p, and agreement across ranks.

The filters follow transformers' logits processors in the order ``generate`` applies them
(repetition penalty, temperature, top-k, top-p), so a setting means the same under both backends.
With several processes every rank takes rank 0's choice (a broadcast): sampled tokens could
otherwise differ between ranks (different generator states or last-bit logit differences), the
sequences would diverge, and the FSDP all-gathers of ranks that stopped would never be matched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SamplingOptions:
    """How a token is chosen (the resolved ``inference:`` section plus command-line flags)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0


def apply_repetition_penalty(scores: torch.Tensor, sequences: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive and multiply negative scores of tokens present in ``sequences`` by ``penalty``."""
    if penalty == 1.0:
        return scores
    seen = torch.gather(scores, 1, sequences)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(1, sequences, seen)


def filter_logits(scores: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, then top-p (removed tokens get ``-inf``)."""
    scores = scores / options.temperature if options.temperature != 1.0 else scores
    if options.top_k > 0:
        k = min(options.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if options.top_p < 1.0:
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - options.top_p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, index, drop), float("-inf"))
    return scores


def next_tokens(
    logits: torch.Tensor,
    sequences: torch.Tensor,
    options: SamplingOptions,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token of every row ``[B]`` from the last position's ``logits`` ``[B, vocab]``.

    Args:
        logits: Float scores of the next token.
        sequences: Every token of each row so far (prompt with padding, then generated), for the penalty.
        options: Greedy or sampling, and the filters.
        generator: Source of randomness when sampling (on the logits' device).
    """
    scores = apply_repetition_penalty(logits.float(), sequences, options.repetition_penalty)
    if not options.do_sample:
        chosen = scores.argmax(dim=-1)
    else:
        probs = filter_logits(scores, options).softmax(dim=-1)
        chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return agree_across_ranks(chosen)


def agree_across_ranks(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's tokens on every rank (unchanged with one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0)
    return tokens
