"""Encode ranking examples into pair rows, as LLaMA-Factory's pairwise processor does.

`encode_pair` is `PairwiseDatasetProcessor._encode_data_example` (LLaMA-Factory's
`data/processor/pairwise.py`): the history and the last user turn are the prompt (the template's
`encode_oneturn`), each answer is encoded after it, and `cutoff_len` is split once with
`infer_seqlen(prompt, longer answer)`, so both answers keep the same (truncated) prompt and are cut
to the same budget. The prompt is never trained.

A pair is stored as one neat-packed row: the chosen sequence (segment 1) then the rejected one
(segment 2), position ids restarting at 0 for each, so one forward serves both and no pair is ever
split between micro-batches or ranks. A row is at most `2 * cutoff_len` tokens. Labels are stored
unshifted; after the loader's shift the last chosen position's target is the rejected sequence's
first (prompt) token, which is -100, so each segment's labels stay inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def encode_pair_batch(
    batch: dict[str, list],
    *,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
) -> dict[str, list]:
    """`datasets.map(batched=True)`: one pair row per usable example (rows with an `_error` dropped)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for i in range(len(batch["_prompt"])):
        if batch["_error"][i]:
            continue
        row = pair_row(
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
        for key, values in row.items():
            out[key].append(values)
    return out
