"""What every family's args dataclass offers (``models/<family>/args.py``), torch-free.

Its own module, below both ``models/spec.py`` (which re-exports it) and the shared HF adapter
(``hf_adapter.py``), so that the adapter base class can name a family's args without importing
the spec module that builds the identity adapter by default.
"""

from __future__ import annotations

from typing import Protocol


class FamilyArgs(Protocol):
    """What every family's args dataclass offers (``models/<family>/args.py``)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table."""
        ...

    def to_hf_dict(self) -> dict[str, object]:
        """The transformers ``config.json`` fields of these args."""
        ...


__all__ = ["FamilyArgs"]
