"""Options of `BlendedMegatronDatasetDataLoader`, checkable without data (LIGHT: pydantic only).

Consumed by `meshforge.data.megatron.loader.build_megatron_loader` (and its eval twin).

The shape is MindFormers' (reference/mindformers-pynative-train-config.zh.txt):

    train_dataset:
      dataloader:
        type: BlendedMegatronDatasetDataLoader
        datasets_type: GPTDataset
        sizes: [1000, 0, 0]          # optional: default train samples = steps x global batch
        column_names: [input_ids, labels, loss_mask, position_ids]
        shuffle: False               # GPTDataset already shuffles with its own seed
        config:
          seq_length: 4096
          split: "1, 0, 0"
          eod: 1                     # optional: default from the tokenizer (<|endoftext|>, else eos)
          pad: -1
          data_path: ['1', /path/megatron_data_text_document]
          ...

`column_names` is a declared field of every dataloader (`data/config.py`); its values are checked by
the builder against `COLUMN_NAMES`. The batch always follows DESIGN.md's contract: `loss_mask` is
folded into `labels` (-100), `attention_mask` / `actual_seq_len` become `segment_ids`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from meshforge.data.options import LoaderOptions

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig

# Columns MindFormers / Megatron name, and what each becomes in the meshforge batch.
COLUMN_NAMES = {
    "input_ids": "input_ids",
    "tokens": "input_ids",
    "labels": "labels",
    "loss_mask": "labels (-100 where the loss mask is 0)",
    "position_ids": "position_ids",
    "attention_mask": "segment_ids (with reset_attention_mask; else the causal mask)",
    "actual_seq_len": "segment_ids",
}


class MegatronSequenceSettings(BaseModel):
    """The sequence length in `train_dataset.dataloader.config`, readable from a config fragment."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seq_length: StrictInt = Field(gt=1, description="Tokens per sample (model input length).")


class MegatronDatasetOptions(MegatronSequenceSettings):
    """`train_dataset.dataloader.config`: the GPTDataset settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_path: list[str] = Field(
        description="Megatron blend list: dataset prefixes (without .bin/.idx), optionally as "
        "'weight, prefix' pairs, e.g. ['0.3', 'data/a_text_document', '0.7', 'data/b_text_document']. "
        "An entry may also be a raw file or folder (parquet, arrow, csv, json, jsonl, txt), converted "
        "to .bin/.idx once before training (data/megatron/raw.py)."
    )
    append_eod: StrictBool = Field(
        default=False, description="Raw files: end each document with the EOD id when converting them."
    )
    overwrite_cache: StrictBool = Field(
        default=False, description="Raw files: convert again even when a matching .bin/.idx exists."
    )
    tokenized_path: str | None = Field(
        default=None, description="Raw files: folder of the converted .bin/.idx; default next to the data."
    )
    preprocessing_num_workers: StrictInt | None = Field(
        default=None, ge=1, description="Raw files: tokenizer processes of the conversion (default 1)."
    )
    split: str = Field(default="1,0,0", description="Train, valid, test proportions of each dataset.")
    eod: StrictInt | None = Field(
        default=None,
        description="End-of-document id; default: <|endoftext|> when the tokenizer has it, else eos_token.",
    )
    pad: StrictInt = Field(default=-1, description="Id padding a final partial sample (-1: none in data).")
    seed: StrictInt | None = Field(
        default=None, description="Seed of the document and sample shuffle; default training.seed."
    )
    create_attention_mask: StrictBool = Field(
        default=False, description="Separate documents in attention (with reset_attention_mask)."
    )
    create_compressed_eod_mask: StrictBool = Field(
        default=False, description="MindFormers' actual_seq_len: documents do not attend to each other."
    )
    eod_pad_length: StrictInt = Field(default=128, gt=0, description="Length of actual_seq_len.")
    reset_position_ids: StrictBool = Field(default=False, description="Restart position ids after each EOD.")
    reset_attention_mask: StrictBool = Field(
        default=False, description="No attention across EODs (emitted as segment_ids)."
    )
    eod_mask_loss: StrictBool = Field(default=False, description="No loss where the input token is EOD.")
    add_extra_token_to_sequence: StrictBool = Field(
        default=True, description="Samples of seq_length + 1 tokens, neighbours sharing one (Megatron)."
    )
    path_to_cache: str | None = Field(
        default=None, description="Folder of the cached indices; default <data dir>/cache/GPTDataset_indices."
    )

    @field_validator("data_path", mode="before")
    @classmethod
    def _blend_list(cls, value: object) -> object:
        # YAML gives weights as numbers or strings; Megatron reads them with float() either way.
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(f"must be a non-empty list of prefixes (optionally with weights), got {value!r}")
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, str | int | float):
                raise ValueError(f"entries must be prefixes or numeric weights, got {item!r}")
            out.append(str(item))
        return out

    @field_validator("split")
    @classmethod
    def _split(cls, value: str) -> str:
        numbers = [float(v) for v in re.findall(r"[.0-9]+", value)]
        if not numbers or len(numbers) > 3 or sum(numbers) <= 0:
            raise ValueError(f"expected 1 to 3 comma-separated proportions like '99,1,0', got {value!r}")
        return value


class MegatronSequenceOptions(LoaderOptions):
    """The sequence length of `BlendedMegatronDatasetDataLoader`, readable from a config fragment."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    config: MegatronSequenceSettings = Field(description="The dataset settings (data_path, seq_length, ...).")

    def sequence(self, data: TrainDatasetConfig) -> tuple[int, str]:
        return self.config.seq_length, "train_dataset.dataloader.config.seq_length"


class MegatronDataLoaderOptions(MegatronSequenceOptions):
    """Options of `BlendedMegatronDatasetDataLoader` (besides the declared dataloader fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    datasets_type: Literal["GPTDataset"] = Field(
        default="GPTDataset", description="Dataset class; GPTDataset is the one built."
    )
    sizes: list[StrictInt] | None = Field(
        default=None,
        description="Samples of the train, valid and test splits; default train = steps x global batch.",
    )
    config: MegatronDatasetOptions = Field(description="The dataset settings (data_path, seq_length, ...).")

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not 1 <= len(value) <= 3 or any(v < 0 for v in value)):
            raise ValueError(f"must be 1 to 3 non-negative sample counts [train, valid, test], got {value!r}")
        return value
