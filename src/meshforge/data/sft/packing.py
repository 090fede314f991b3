"""Pack encoded SFT examples into fixed-length rows, as LLaMA-Factory's packed processor does.

Within one preprocessing batch (packing never crosses batches), examples are encoded with
`cutoff_len - 1` tokens, grouped by `greedy_knapsack` and concatenated; each row is right-padded to
`cutoff_len` (pad id, position 0, label -100). `position_ids` restart at 0 for every example. With
`neat_packing`, `segment_ids` number the examples 1, 2, ... (0 = padding) so the model attends only
within an example; plain packing lets examples attend to earlier ones in the row, as in
LLaMA-Factory (position ids still restart).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TYPE_CHECKING

from meshforge.data.sft.processor import IGNORE_INDEX, encode_example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.sft.templates import Template


def greedy_knapsack(numbers: list[int], capacity: int) -> list[list[int]]:
    """LLaMA-Factory's greedy knapsack: fill each bin with the largest length that still fits."""
    numbers = sorted(numbers)
    knapsacks = []
    while numbers:
        current, remaining = [], capacity
        while True:
            index = bisect.bisect(numbers, remaining) - 1
            if index < 0:
                break
            remaining -= numbers[index]
            current.append(numbers.pop(index))
        if not current:  # an item longer than the capacity would loop forever; callers drop those
            raise ValueError(f"an example of {numbers[0]} tokens cannot fit a pack of {capacity}")
        knapsacks.append(current)
    return knapsacks


def pack_examples(
    examples: list[tuple[list[int], list[int]]], *, cutoff_len: int, pad_id: int, neat: bool
) -> dict[str, list]:
    """Pack encoded (ids, labels) examples (each at most `cutoff_len - 1` long) into rows of `cutoff_len`."""
    capacity = cutoff_len - 1
    lengths, by_length = [], defaultdict(list)
    kept: list[tuple[list[int], list[int]]] = []
    for ids, labels in examples:
        if len(ids) > capacity:
            continue  # LLaMA-Factory drops these ("lengthy example")
        by_length[len(ids)].append(len(kept))
        lengths.append(len(ids))
        kept.append((ids, labels))
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    if neat:
        rows["segment_ids"] = []
    for knapsack in greedy_knapsack(lengths, capacity):
        ids_row: list[int] = []
        labels_row: list[int] = []
        pos_row: list[int] = []
        seg_row: list[int] = []
        for i, length in enumerate(knapsack):
            ids, labels = kept[by_length[length].pop()]
            ids_row += ids
            labels_row += labels
            pos_row += range(len(ids))
            seg_row += [i + 1] * len(ids)
        pad = cutoff_len - len(ids_row)
        ids_row += [pad_id] * pad
        labels_row += [IGNORE_INDEX] * pad
        pos_row += [0] * pad
        seg_row += [0] * pad
        rows["input_ids"].append(ids_row)
        rows["labels"].append(labels_row)
        rows["position_ids"].append(pos_row)
        if neat:
            rows["segment_ids"].append(seg_row)
    return rows


def pack_batch(
    batch: dict[str, list],
    *,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
    train_on_prompt: bool,
    mask_history: bool,
    neat: bool,
) -> dict[str, list]:
    """`datasets.map(batched=True)`: encode a batch with `cutoff_len - 1` and pack it."""
    examples = []
    for i in range(len(batch["_prompt"])):
        if batch["_error"][i]:
            continue
        examples.append(
            encode_example(
                template,
                tokenizer,
                batch["_prompt"][i],
                batch["_response"][i],
                batch["_system"][i],
                batch["_tools"][i],
                cutoff_len=cutoff_len - 1,
                train_on_prompt=train_on_prompt,
                mask_history=mask_history,
            )
        )
    return pack_examples(examples, cutoff_len=cutoff_len, pad_id=tokenizer.pad_token_id, neat=neat)
