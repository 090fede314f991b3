"""Options of `TextDataLoader` (LIGHT: pydantic only); consumed by `meshforge.data.text.build_text_loader`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import ConfigDict, Field, StrictBool, StringConstraints, field_validator

from meshforge.data.options import LoaderOptions

if TYPE_CHECKING:
    from meshforge.data.config import TrainDatasetConfig


class TextSequenceOptions(LoaderOptions):
    """The sequence length of `TextDataLoader`, readable from a config fragment without data_path."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seq_length: int = Field(gt=0, description="Tokens per sample (model input length).")

    @field_validator("seq_length", mode="before")
    @classmethod
    def _no_bool(cls, value: object) -> object:
        # pydantic would read `true` as 1; a bool is never a number in meshforge configs.
        if isinstance(value, bool):
            raise ValueError(f"must be a positive integer, got {value!r}")
        return value

    def sequence(self, data: TrainDatasetConfig) -> tuple[int, str]:
        return self.seq_length, "train_dataset.dataloader.seq_length"


class TextDataLoaderOptions(TextSequenceOptions):
    """Raw text files tokenized and packed into fixed-length samples (`data/text.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_path: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        description="Text data: a file (.jsonl, .json, .txt) or folder of them, or a list of those; "
        "meshforge:// names bundled files, other relative paths resolve against the working directory."
    )
    text_key: str = Field(default="text", min_length=1, description="JSON key that holds a document's text.")
    append_eod: StrictBool = Field(
        default=True, description="Append the end-of-document token after every document."
    )
    max_documents: int | None = Field(
        default=None,
        gt=0,
        description="Read at most this many documents of each file (LLaMA-Factory's max_samples); null = all.",
    )

    @field_validator("data_path", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        # A single path is the common case in YAML; keep one internal shape.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError("must name at least one file or folder")
        else:
            raise ValueError(f"must be a path or a list of paths, got {value!r}")
        return value
