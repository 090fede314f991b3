"""Training callbacks: the `callbacks:` list items (light at import; callback code comes later).

Each item names a registered callback by `type`; its other keys pass through to the callback's
constructor. No user callbacks are built yet, so any item is refused at train start (see
`meshforge.config.unsupported`).
"""

from __future__ import annotations

from pydantic import field_validator

from meshforge.config.base import PassthroughSection, describe


class CallbackConfig(PassthroughSection):
    """One extra callback; other keys are its constructor arguments."""

    type: str = describe(..., "Registered callback class name (required).")

    @field_validator("type")
    @classmethod
    def _non_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a registered callback type")
        return value
