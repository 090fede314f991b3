"""Encode aligned examples into `input_ids`/`labels` exactly as LLaMA-Factory's supervised processor.

`encode_example` is `SupervisedDatasetProcessor._encode_data_example` (LLaMA-Factory's `data/processor/supervised.py`): turn pairs are
truncated with `infer_seqlen` against the budget left, prompts are masked with -100 unless
`train_on_prompt`, and under `mask_history` the pairs are walked last-first so the final turn keeps
its budget and only it is trained (with efficient eos, earlier turns' eos stays masked too, the fix
of LLaMA-Factory PR #10827). Labels here are *unshifted* (label i is token i, as LLaMA-Factory
stores them); the loader shifts them into the batch contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.data.sft.templates import Template

IGNORE_INDEX = -100


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of `cutoff_len` between a prompt and its response."""
    if target_len * 2 < cutoff_len:  # a short response is kept whole
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:  # a short prompt is kept whole
        max_target_len = cutoff_len - source_len
    else:  # both long: proportional shares
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def encode_example(
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict],
    response: list[dict],
    system: str,
    tools: str,
    *,
    cutoff_len: int,
    train_on_prompt: bool,
    mask_history: bool,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one example; see the module docstring."""
    pairs = template.encode_multiturn(tokenizer, prompt + response, system, tools)
    eos = tokenizer.eos_token_id
    total = 1 if template.efficient_eos else 0
    if mask_history:
        pairs = pairs[::-1]
    input_ids: list[int] = []
    labels: list[int] = []
    for turn, (source, target) in enumerate(pairs):
        if total >= cutoff_len:
            break
        s, t = infer_seqlen(len(source), len(target), cutoff_len - total)
        source, target = source[:s], target[:t]
        total += s + t
        if train_on_prompt:
            source_label = source
        elif template.efficient_eos and turn != 0 and not mask_history:
            # The eos that ends the previous answer sits at the start of this prompt; it is trained
            # with that answer. Under mask_history earlier answers are not trained, so neither is
            # their eos (LLaMA-Factory keeps it: its PR #10827; the one deliberate difference).
            source_label = [eos] + [IGNORE_INDEX] * (s - 1)
        else:
            source_label = [IGNORE_INDEX] * s
        target_label = [IGNORE_INDEX] * t if mask_history and turn != 0 else target
        if mask_history:
            input_ids = source + target + input_ids
            labels = source_label + target_label + labels
        else:
            input_ids += source + target
            labels += source_label + target_label
    if template.efficient_eos:
        input_ids += [eos]
        labels += [eos]
    return input_ids, labels


def encode_batch(
    batch: dict[str, list],
    *,
    template: Template,
    tokenizer: PreTrainedTokenizerBase,
    cutoff_len: int,
    train_on_prompt: bool,
    mask_history: bool,
) -> dict[str, list]:
    """`datasets.map(batched=True)`: encode every usable row (rows with an `_error` are dropped)."""
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for i in range(len(batch["_prompt"])):
        if batch["_error"][i]:
            continue
        ids, labels = encode_example(
            template,
            tokenizer,
            batch["_prompt"][i],
            batch["_response"][i],
            batch["_system"][i],
            batch["_tools"][i],
            cutoff_len=cutoff_len,
            train_on_prompt=train_on_prompt,
            mask_history=mask_history,
        )
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out
