"""Encode ranking examples into pair rows, as LLaMA-Factory's pairwise processor does.

`encode_pair` is `PairwiseDatasetProcessor._encode_data_example` (LLaMA-Factory's
`data/processor/pairwise.py`): the history and the last user turn are the prompt (the template's
`encode_oneturn`), each answer is encoded after it, and `cutoff_len` is split once with
`infer_seqlen(prompt, longer answer)`, so both answers keep the same (truncated) prompt and are cut
to the same budget. The prompt is never trained.

A pair is stored in a neat-packed row: the chosen sequence (segment 1) then the rejected one
(segment 2), position ids restarting at 0 for each, so one forward serves both and no pair is ever
split between micro-batches or ranks. A row is at most `2 * cutoff_len` tokens. With packing
(`pack_pair_batch`) several pairs share a row, pair k in segments 2k + 1 and 2k + 2, placed by
LLaMA-Factory's greedy knapsack within each preprocessing batch. Labels are stored unshifted;
after the loader's shift a position whose target lies in the next segment belongs to no sequence
(`loss/sequence_logps.py` leaves it out).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from meshforge.data.sft.packing import greedy_knapsack
from meshforge.data.sft.processor import IGNORE_INDEX, infer_seqlen

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.sft.templates import Template

CHOSEN_SEGMENT, REJECTED_SEGMENT = 1, 2


def encode_pair(
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict],
    response: list[dict],
    system: str,
    tools: str,
    *,
    cutoff_len: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen ids, chosen labels, rejected ids, rejected labels) of one ranking example."""
    prompt_ids, chosen_ids = template.encode_oneturn(tokenizer, prompt + [response[0]], system, tools)
    _, rejected_ids = template.encode_oneturn(tokenizer, prompt + [response[1]], system, tools)
    if template.efficient_eos:
        chosen_ids = chosen_ids + [tokenizer.eos_token_id]
        rejected_ids = rejected_ids + [tokenizer.eos_token_id]
    # The answers matter more than the prompt: the longer one sets the split.
    source_len, target_len = infer_seqlen(
        len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), cutoff_len
    )
    prompt_ids = prompt_ids[:source_len]
    chosen_ids, rejected_ids = chosen_ids[:target_len], rejected_ids[:target_len]
    masked = [IGNORE_INDEX] * source_len
    return prompt_ids + chosen_ids, masked + chosen_ids, prompt_ids + rejected_ids, masked + rejected_ids


def pair_row(
    chosen_ids: list[int], chosen_labels: list[int], rejected_ids: list[int], rejected_labels: list[int]
) -> dict[str, list[int]]:
    """One pair as a neat-packed row: chosen (segment 1), then rejected (segment 2)."""
    return {
        "input_ids": chosen_ids + rejected_ids,
        "labels": chosen_labels + rejected_labels,
        "position_ids": list(range(len(chosen_ids))) + list(range(len(rejected_ids))),
        "segment_ids": [CHOSEN_SEGMENT] * len(chosen_ids) + [REJECTED_SEGMENT] * len(rejected_ids),
    }


def _pair_rows(
    batch: dict[str, list], template: Template, tokenizer: PreTrainedTokenizerBase, cutoff_len: int
) -> list[dict[str, list[int]]]:
    """The pair row of every usable example of a converted batch (rows with an `_error` dropped)."""
    return [
        pair_row(
            *encode_pair(
                template,
                tokenizer,
                batch["_prompt"][i],
                batch["_response"][i],
                batch["_system"][i],
                batch["_tools"][i],
                cutoff_len=cutoff_len,
            )
        )
        for i in range(len(batch["_prompt"]))
        if not batch["_error"][i]
    ]


def _columns(rows: list[dict[str, list[int]]]) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for row in rows:
        for key, values in row.items():
            out[key].append(values)
    return out


def encode_pair_batch(
    batch: dict[str, list],
    *,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
) -> dict[str, list]:
    """`datasets.map(batched=True)`: one pair row per usable example."""
    return _columns(_pair_rows(batch, template, tokenizer, cutoff_len))


def pack_pair_batch(
    batch: dict[str, list],
    *,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
) -> dict[str, list]:
    """`datasets.map(batched=True)`: the batch's pair rows packed into rows of `2 * cutoff_len` tokens.

    Every pair fits (each sequence is at most `cutoff_len`); rows are not padded here (the loader
    pads every row to its length).
    """
    pairs = _pair_rows(batch, template, tokenizer, cutoff_len)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        by_length[len(pair["input_ids"])].append(i)
    rows = []
    for knapsack in greedy_knapsack([len(p["input_ids"]) for p in pairs], 2 * cutoff_len):
        row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
        for k, length in enumerate(knapsack):
            pair = pairs[by_length[length].pop()]
            for key in ("input_ids", "labels", "position_ids"):
                row[key] += pair[key]
            row["segment_ids"] += [seg + 2 * k for seg in pair["segment_ids"]]
        rows.append(row)
    return _columns(rows)
