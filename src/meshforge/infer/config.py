"""`inference:` section: generation settings for `meshforge generate` (light; generation comes later).

The native home of MindSpeed-LLM InferenceArguments.
"""

from __future__ import annotations

from typing import Literal

from meshforge.config.base import Bool, PosInt, StrictSection, describe


class InferenceConfig(StrictSection):
    """Text generation options."""

    infer_backend: Literal["huggingface"] = describe("huggingface", "Generation engine.")
    max_new_tokens: PosInt = describe(512, "Maximum number of generated tokens (prompt excluded).")
    do_sample: Bool = describe(False, "Sample instead of greedy decoding.")
