"""`train_dataset:` section: the data loader and its data (light: pydantic only).

`train_dataset.dataloader` keeps undeclared keys for the loader named by its `type`; they are parsed
once, at validation, with that loader's options model and kept typed in `DataloaderConfig.options`.
The parsing is the loader registry's (`meshforge.data.specs.parse_section_options`): this module
imports no other data module, so the registry, the options models and the builders may all name
`TrainDatasetConfig`. The registry hands its parser over with `use_options_parser` when it is
imported, and `meshforge/data/__init__.py` imports it, so that no section of this module is ever
validated without it. The SFT fields of MindSpeed-LLM DataArguments live directly under
`train_dataset`, with the `__post_init__` rules of that class, one of them done better:
`interleave_probs` is checked against the real number of datasets, not the characters of a string.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from pydantic import BaseModel, PrivateAttr, field_validator, model_validator

from meshforge.config.base import (
    Bool,
    Int,
    NonNegFloat,
    PassthroughSection,
    PosInt,
    StrictSection,
    describe,
    rule_error,
)

OptionsT = TypeVar("OptionsT", bound=BaseModel)

SFT_LOADER = "SFTDataLoader"
MEGATRON_LOADER = "BlendedMegatronDatasetDataLoader"

# Built chat templates (`train_dataset.template`; null = the tokenizer's own chat_template) and tool
# formats, listed here so the section checks names without importing the templates module.
TEMPLATE_NAMES = ("qwen3", "qwen3_nothink", "chatml", "llama3", "empty", "gpt", "gpt_oss")
TOOL_FORMATS = ("qwen",)


class LoaderOptionsModel(Protocol):
    """What this section asks of a loader's options (`meshforge.data.options.LoaderOptions`)."""

    def sequence(self, data: TrainDatasetConfig) -> tuple[int, str]: ...


@dataclass(frozen=True)
class ParsedOptions:
    """The registry's reading of one `dataloader` section's passthrough keys.

    Attributes:
        options: the typed options of the loader named by `type`; None when they do not parse.
        sequence: the options, or only their sequence-length part when the others do not parse
            (yet); None when neither parses.
        issues: (key relative to the section, reason) for each problem of `type` and its options.
    """

    options: LoaderOptionsModel | None
    sequence: LoaderOptionsModel | None
    issues: tuple[tuple[str, str], ...] = ()


OptionsParser = Callable[[str | None, Mapping[str, object]], ParsedOptions]
_PARSER: list[OptionsParser] = []


def use_options_parser(parser: OptionsParser) -> None:
    """Install the loader registry's parser (called once, by `meshforge.data.specs`).

    The default `dataloader` section, built with this module before any parser existed, is
    parsed now, so that it equals a section validated from the same (empty) keys.
    """
    _PARSER[:] = [parser]
    default = TrainDatasetConfig.model_fields["dataloader"].default
    if isinstance(default, DataloaderConfig):
        default._parsed = parser(default.type, default.model_extra or {})


def _parse(type_name: str | None, extra: Mapping[str, object]) -> ParsedOptions:
    if not _PARSER:
        raise RuntimeError("meshforge.data.specs was not imported: no loader options parser")
    return _PARSER[0](type_name, extra)


class DataloaderConfig(PassthroughSection):
    """The loader type and the options every loader shares; others pass through to the type."""

    type: str | None = describe(
        None, "Loader type, e.g. TextDataLoader (raw text), BlendedMegatronDatasetDataLoader, SFTDataLoader."
    )
    shuffle: Bool = describe(False, "Shuffle the sample order (seeded by training.seed).")
    column_names: list[str] = describe(["input_ids", "labels"], "Columns produced by the dataset.")
    python_multiprocessing: Bool = describe(False, "Load with Python worker processes.")

    _parsed: ParsedOptions | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _parse_options(self) -> DataloaderConfig:
        # The options of a built loader are parsed here, once (by the registry, which raises a
        # bad sequence length as an error now and returns the other problems as issues). Only the
        # field default of `TrainDatasetConfig.dataloader`, built while the registry itself is
        # being imported, finds no parser; `use_options_parser` parses it.
        if _PARSER:
            self._parsed = _parse(self.type, self.model_extra or {})
        return self

    def _result(self) -> ParsedOptions:
        if self._parsed is None:
            self._parsed = _parse(self.type, self.model_extra or {})
        return self._parsed

    @property
    def options(self) -> LoaderOptionsModel | None:
        """The parsed options of the loader named by `type`; None when it names no built loader."""
        return self._result().options

    def option_issues(self) -> list[tuple[str, str]]:
        """(key relative to this section, reason) for each problem of `type` and its options,
        found when the section was validated; empty when the options parsed."""
        return list(self._result().issues)

    @property
    def sequence_options(self) -> LoaderOptionsModel | None:
        """The options, or only their sequence-length part when the others do not parse (yet)."""
        return self._result().sequence

    def options_as(self, model: builtins.type[OptionsT]) -> OptionsT:
        """The parsed options, which must be of `model` (the builder of that loader asks).

        Raises:
            ValueError: the options do not parse (every problem, with its key path), or `type`
                names another loader (or none).
        """
        parsed = self._result()
        if parsed.options is None and parsed.issues:
            raise ValueError("\n".join(f"train_dataset.dataloader.{k}: {r}" for k, r in parsed.issues))
        if not isinstance(parsed.options, model):
            raise ValueError(
                f"train_dataset.dataloader.type: {self.type!r} does not take {model.__name__} options"
            )
        return parsed.options


def count_datasets(dataset: object) -> int:
    """How many datasets `dataset` names: a list, comma-separated names, or one inline dict."""
    if dataset is None:
        return 0
    if isinstance(dataset, list):
        return len(dataset)
    if isinstance(dataset, dict):
        return 1
    return len([name for name in str(dataset).split(",") if name.strip()])


# SFT (MindSpeed DataArguments) field names, so the unsupported list can find them in one place.
SFT_FIELDS = (
    "template",
    "dataset",
    "eval_dataset",
    "dataset_dir",
    "cutoff_len",
    "train_on_prompt",
    "mask_history",
    "streaming",
    "buffer_size",
    "mix_strategy",
    "interleave_probs",
    "overwrite_cache",
    "preprocessing_batch_size",
    "preprocessing_num_workers",
    "max_samples",
    "eval_num_beams",
    "ignore_pad_token_for_loss",
    "val_size",
    "eval_on_each_dataset",
    "packing",
    "neat_packing",
    "tool_format",
    "default_system",
    "enable_thinking",
    "tokenized_path",
    "data_shared_file_system",
    "no_shared_storage",
    "create_attention_mask_in_dataloader",
    "dataloader_type",
    "reset_attention_mask",
    "append_eod",
)


class TrainDatasetConfig(StrictSection):
    """Training data: the loader plus options that apply to every loader and the SFT data fields."""

    dataloader: DataloaderConfig = describe(DataloaderConfig(), "Loader type and its options.")
    drop_remainder: Bool = describe(True, "Drop the last incomplete batch.")
    num_parallel_workers: Int = describe(8, "Data loading workers (MindSpeed dataloader_num_workers).")
    prefetch_size: PosInt = describe(1, "Batches prefetched per worker.")
    numa_enable: Bool = describe(False, "Bind loader workers to the NUMA node of the device.")
    use_distribute_dataset: Bool = describe(False, "Use a distributed dataset (MindFormers switch).")
    pin_memory: Bool = describe(True, "Pin host memory of batches (MindSpeed dataloader_pin_memory).")
    persistent_workers: Bool = describe(False, "Keep loader workers alive between epochs.")
    # SFT data (MindSpeed-LLM / LLaMA-Factory DataArguments).
    template: str | None = describe(None, "Chat template name (e.g. qwen3); null = from the tokenizer.")
    dataset: dict[str, object] | str | list[str] | None = describe(
        None, "SFT dataset(s): comma-separated names from dataset_info.json, a list, or an inline dict."
    )
    eval_dataset: dict[str, object] | str | list[str] | None = describe(
        None, "Evaluation dataset(s); exclusive with val_size."
    )
    dataset_dir: str = describe("./configs/fsdp2/data", "Folder holding dataset_info.json and data files.")
    cutoff_len: PosInt = describe(2048, "Maximum tokens per encoded example (the packed row length).")
    train_on_prompt: Bool = describe(False, "Also train on prompt tokens; exclusive with mask_history.")
    mask_history: Bool = describe(False, "Train only on the last turn; exclusive with train_on_prompt.")
    streaming: Bool = describe(
        False, "Stream the dataset; needs an integer val_size, exclusive with max_samples."
    )
    buffer_size: PosInt = describe(16384, "Shuffle buffer size when streaming.")
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = describe(
        "concat", "How several datasets are mixed."
    )
    interleave_probs: str | list[NonNegFloat] | None = describe(
        None, "Sampling probability per dataset for interleave strategies (comma-separated or a list)."
    )
    overwrite_cache: Bool = describe(False, "Rebuild cached preprocessed data.")
    preprocessing_batch_size: PosInt = describe(
        1000, "Examples per preprocessing batch (packing never crosses batches)."
    )
    preprocessing_num_workers: PosInt | None = describe(None, "Preprocessing processes.")
    max_samples: PosInt | None = describe(None, "Keep only the first N examples of each dataset (debugging).")
    eval_num_beams: PosInt | None = describe(None, "Beams used by generation during evaluation.")
    ignore_pad_token_for_loss: Bool = describe(True, "Exclude padding from the loss.")
    val_size: NonNegFloat = describe(0.0, "Validation split: a fraction in (0, 1) or a number of examples.")
    eval_on_each_dataset: Bool = describe(
        False, "Encode and evaluate each eval_dataset on its own (eval_loss/<name>); no effect with val_size."
    )
    packing: Bool = describe(False, "Pack several examples per row (greedy knapsack).")
    neat_packing: Bool = describe(False, "Packing without cross-example attention (forces packing on).")
    tool_format: str | None = describe(None, "Tool-call format used by the template.")
    default_system: str | None = describe(None, "System prompt replacing the template's default.")
    enable_thinking: Bool | None = describe(
        True, "Reasoning templates: keep/add thinking (null keeps data as is)."
    )
    tokenized_path: str | None = describe(None, "Folder to save or load the tokenized dataset.")
    data_shared_file_system: Bool = describe(False, "Data lives on a file system shared by all nodes.")
    no_shared_storage: Bool = describe(False, "Each node preprocesses its own copy.")
    create_attention_mask_in_dataloader: Bool = describe(
        False, "Build explicit attention masks in the loader."
    )
    dataloader_type: Literal["single"] = describe("single", "Sampler kind: single (sequential) only.")
    reset_attention_mask: Bool = describe(
        False, "Pretraining packs: no attention across EOD (needs append_eod, batch 1)."
    )
    append_eod: Bool = describe(False, "Append an EOD token to each document when preprocessing.")

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None and value not in TEMPLATE_NAMES:
            raise ValueError(f"unknown template {value!r} (built: {', '.join(TEMPLATE_NAMES)}, or null)")
        return value

    @field_validator("tool_format")
    @classmethod
    def _known_tool_format(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_FORMATS:
            raise ValueError(f"tool format {value!r} is not built (built: {', '.join(TOOL_FORMATS)})")
        return value

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == {} else value

    @model_validator(mode="before")
    @classmethod
    def _neat_forces_packing(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("neat_packing") is True and "packing" not in data:
            data = {**data, "packing": True}
        return data

    @model_validator(mode="after")
    def _rules(self) -> TrainDatasetConfig:
        if self.val_size > 1e-6:
            if self.dataset is None:
                raise rule_error("val_size", "a validation split needs train_dataset.dataset")
            if self.eval_dataset is not None:
                raise rule_error("val_size", "val_size and train_dataset.eval_dataset are mutually exclusive")
        if self.interleave_probs is not None:
            if self.mix_strategy == "concat":
                raise rule_error(
                    "interleave_probs",
                    "only used with mix_strategy interleave_under/interleave_over, not concat",
                )
            probs = self.probabilities()
            n = count_datasets(self.dataset)
            if len(probs) != n:
                raise rule_error(
                    "interleave_probs",
                    f"has {len(probs)} values but train_dataset.dataset names {n} dataset(s)",
                )
        if self.streaming:
            if self.val_size > 1e-6 and self.val_size != int(self.val_size):
                raise rule_error(
                    "val_size",
                    f"streaming needs an integer val_size (a number of examples), got {self.val_size}",
                )
            if self.max_samples is not None:
                raise rule_error("max_samples", "cannot be combined with streaming")
        if self.mask_history and self.train_on_prompt:
            raise rule_error("mask_history", "mask_history and train_on_prompt are mutually exclusive")
        if self.neat_packing and not self.packing:
            raise rule_error("packing", "neat_packing requires packing (leave packing unset or true)")
        if self.reset_attention_mask and not self.append_eod:
            raise rule_error("reset_attention_mask", "requires train_dataset.append_eod: true")
        return self

    def probabilities(self) -> list[float]:
        """`interleave_probs` as floats (empty when unset)."""
        value = self.interleave_probs
        if value is None:
            return []
        if isinstance(value, list):
            return list(value)
        try:
            return [float(p) for p in value.split(",") if p.strip()]
        except ValueError:
            raise rule_error("interleave_probs", f"must be comma-separated numbers, got {value!r}") from None

    def seq_length_source(self) -> tuple[int, str] | None:
        """(tokens per sample, the key path that sets it), from the loader's parsed options.

        `dataloader.seq_length` (text loader), `dataloader.config.seq_length` (Megatron loader), or
        `cutoff_len` for the SFT loader. None when `dataloader.type` names no built loader or the
        options do not set it yet (a bad value is a validation error when the config loads).
        """
        options = self.dataloader.sequence_options
        return options.sequence(self) if options is not None else None

    def seq_length(self) -> int | None:
        """The data's sequence length (see `seq_length_source`), or None without a built loader."""
        source = self.seq_length_source()
        return source[0] if source is not None else None
