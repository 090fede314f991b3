"""Beam search on meshforge's own decoder, with the cache reordered to the surviving beams.

The search is transformers' ``generate(num_beams=N, do_sample=False)`` (5.x ``_beam_search``), so
on the same weights it returns the same tokens: every prompt runs as ``N`` rows; a step takes the
``log_softmax`` of the last logits (the repetition penalty applies to those log-probabilities, as
transformers' processors do), adds each beam's running score and keeps the best ``K = max(2, 1 +
n_eos) * N`` continuations over all beams. Those that end (an eos token, or the last allowed token)
and rank among the first ``N`` become finished hypotheses scored ``sum_logprobs / new_len **
length_penalty``; the best ``N`` unfinished ones run on. The cache (keys and values, sliding windows,
MLA latents, Gated DeltaNet states) and the token history are reordered to the rows they continue.

Stopping follows transformers' defaults: ``early_stopping: false`` stops a prompt once the best
running beam, scored at its current length, cannot beat the worst finished hypothesis;
``true`` stops once ``N`` hypotheses are finished; ``never`` scores the best running beam at the
longest length when ``length_penalty > 0``. The answer is the best finished hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.infer.engine import DecodeRequest, Stepper, left_pad
from meshforge.infer.sampling import agree_across_ranks, apply_repetition_penalty

_NEG = -1.0e9  # transformers' "never choose" score


@dataclass(frozen=True)
class BeamOptions:
    """Beam search settings (the ``inference:`` keys of the same names).

    Attributes:
        num_beams: Beams per prompt.
        length_penalty: Exponent of the generated length dividing a finished hypothesis' score.
        early_stopping: ``False``, ``True`` or ``"never"`` (transformers' meaning).
        repetition_penalty: Applied to the log-probabilities of tokens already in the row.
    """

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    repetition_penalty: float = 1.0


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[b, index[b, i], ...]`` for ``tensor`` ``[B, M, ...]`` and ``index`` ``[B, k]``."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


@torch.no_grad()
def beam_search(model: nn.Module, request: DecodeRequest, options: BeamOptions) -> list[list[int]]:
    """The best beam's generated tokens for every prompt (up to and including its eos token).

    Args:
        model: A built-in causal LM (``cache_support(model)`` is None), eval mode, on its device.
        request: Prompts and limits (``use_kv_cache`` false: the whole sequence every step).
        options: Beams, length penalty, early stopping.
    """
    device = next(model.parameters()).device
    beams, max_new = options.num_beams, request.max_new_tokens
    ids, mask = left_pad(request.prompts, request.pad_token_id, device)
    batch = ids.shape[0]
    stepper = Stepper(model, ids.repeat_interleave(beams, 0), mask.repeat_interleave(beams, 0), request)
    eos = torch.tensor(request.eos_token_ids or (-1,), device=device)
    keep = max(2, 1 + len(request.eos_token_ids)) * beams
    top_beams = torch.arange(keep, device=device) < beams

    running = torch.full((batch, beams, max_new), request.pad_token_id, dtype=torch.long, device=device)
    running_scores = torch.zeros(batch, beams, device=device)
    running_scores[:, 1:] = _NEG  # only the first copy of a prompt starts (no duplicate beams)
    finished = running.clone()
    finished_len = torch.zeros(batch, beams, dtype=torch.long, device=device)
    finished_scores = torch.full((batch, beams), _NEG, device=device)
    is_finished = torch.zeros(batch, beams, dtype=torch.bool, device=device)
    improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
    offsets = torch.arange(batch, device=device)[:, None] * beams

    for step in range(max_new):
        log_probs = F.log_softmax(stepper.logits().float(), dim=-1)
        log_probs = apply_repetition_penalty(log_probs, stepper.sequences, options.repetition_penalty)
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(batch, beams, vocab) + running_scores[:, :, None]).view(batch, -1)
        scores = agree_across_ranks(scores.contiguous())
        top_scores, top_index = torch.topk(scores, keep)
        source = top_index // vocab
        candidates = _take(running, source)
        candidates[:, :, step] = top_index % vocab
        ends = torch.isin(candidates[:, :, step], eos) | (step + 1 >= max_new)

        # The best N that go on.
        going = top_scores + ends.float() * _NEG
        chosen = torch.topk(going, beams).indices
        running = _take(candidates, chosen)
        running_scores = _take(going, chosen)
        rows = (_take(source, chosen) + offsets).flatten()

        # Finished hypotheses among the first N candidates, if they beat the ones held.
        done_now = ends & top_beams[None]
        final = top_scores / float(step + 1) ** options.length_penalty
        full = is_finished.all(dim=-1, keepdim=True) & (options.early_stopping is True)
        final = final + full.float() * _NEG + (~improvable).float() * _NEG + (~done_now).float() * _NEG
        merged_scores = torch.cat([finished_scores, final], dim=1)
        best = torch.topk(merged_scores, beams).indices
        finished = _take(torch.cat([finished, candidates], dim=1), best)
        finished_scores = _take(merged_scores, best)
        new_len = torch.full_like(done_now, step + 1, dtype=torch.long)
        finished_len = _take(torch.cat([finished_len, new_len], dim=1), best)
        is_finished = _take(torch.cat([is_finished, done_now], dim=1), best)

        stepper.reorder(rows)
        stepper.append(running[:, :, step].flatten())

        generated = step + 1
        if options.early_stopping == "never" and options.length_penalty > 0.0:
            length = max_new
        else:
            length = generated
        best_running = running_scores[:, :1] / float(length) ** options.length_penalty
        worst = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True).values, _NEG)
        improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
        all_full = bool(is_finished.all()) and options.early_stopping is True
        if not bool(improvable.any()) or all_full or bool(ends.all()):
            break
    return [finished[row, 0, : int(finished_len[row, 0])].tolist() for row in range(batch)]
