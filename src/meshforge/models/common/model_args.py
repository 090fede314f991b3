"""What every family's args object offers to the code around the model, torch-free.

A protocol, so the built-in families' `FamilyArgs` dataclasses and the transformers path's
config wrapper both fit. Its own module, below both `models/spec.py` (which re-exports it) and
the shared HF adapter (`hf_adapter.py`), so the adapter base class can name a family's args
without importing the spec module that builds the identity adapter by default.
"""

from __future__ import annotations

from typing import Protocol


class ModelArgs(Protocol):
    """What every family's args offers (`models/<family>/args.py`)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table."""
        ...

    def to_hf_dict(self) -> dict[str, object]:
        """The transformers `config.json` fields of these args."""
        ...


__all__ = ["ModelArgs"]
