"""`inference:` section: generation settings for `meshforge generate` (light: no torch).

The native home of MindSpeed-LLM's InferenceArguments (`infer_backend`, `max_new_tokens`,
`do_sample`); the other fields are named as transformers' `GenerationConfig` names them, so a
value means the same under both backends. Command-line flags of `meshforge generate` override
them. Beam search (``num_beams > 1``) is greedy: with ``do_sample`` or stop strings it is refused.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import AfterValidator, model_validator

from meshforge.config.base import (
    Bool,
    Float,
    Int,
    NonNegInt,
    PosFloat,
    PosInt,
    StrictSection,
    describe,
    rule_error,
)


def _unit_interval(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must be in (0, 1], got {value}")
    return value


UnitFloat = Annotated[Float, AfterValidator(_unit_interval)]


class InferenceConfig(StrictSection):
    """Text generation options."""

    infer_backend: Literal["huggingface", "meshforge"] = describe(
        "huggingface",
        "Generation engine: `huggingface` (transformers' generate on the exported or generic model) or "
        "`meshforge` (the built-in families' own KV-cache decoder; other families fall back to huggingface).",
    )
    max_new_tokens: PosInt = describe(512, "Maximum number of generated tokens (prompt excluded).")
    do_sample: Bool = describe(False, "Sample instead of greedy decoding.")
    temperature: PosFloat = describe(1.0, "Softmax temperature when sampling.")
    top_p: UnitFloat = describe(1.0, "Nucleus sampling: keep the smallest set of tokens with this much mass.")
    top_k: NonNegInt = describe(0, "Sample among the k most likely tokens; 0 = no top-k filter.")
    repetition_penalty: PosFloat = describe(
        1.0, "Divide positive (multiply negative) logits of tokens already in the sequence by this."
    )
    seed: Int | None = describe(None, "Seed of the sampling generator; null = `training.seed`.")
    stop_strings: list[str] = describe([], "Stop a completion when its text contains one of these.")
    eos_token_id: list[int] | None = describe(
        None, "Token ids that end a completion; null = the model's generation_config / tokenizer eos."
    )
    batch_size: PosInt = describe(8, "Prompts decoded together (left-padded to one length).")
    use_kv_cache: Bool = describe(
        True, "Keep keys and values of earlier tokens (false: recompute the whole sequence every token)."
    )
    num_beams: PosInt | None = describe(
        None,
        "Beam search with this many beams (1: greedy or sampled decoding); null = `train_dataset.eval_num_beams` "
        "when set, else 1.",
    )
    length_penalty: Float = describe(
        1.0, "Beam search: a finished hypothesis scores sum(log-probs) / generated_length ** length_penalty."
    )
    early_stopping: Bool | Literal["never"] = describe(
        False,
        "Beam search stop rule (transformers' meaning): false = when no running beam can beat the finished "
        "ones, true = once num_beams hypotheses are finished, never = only at max_new_tokens' heuristic.",
    )

    @model_validator(mode="after")
    def _beams_are_greedy(self) -> Self:
        if self.num_beams is not None and self.num_beams > 1:
            if self.do_sample:
                raise rule_error(
                    "do_sample", "not supported yet: do_sample with num_beams > 1 (beam sampling)"
                )
            if self.stop_strings:
                raise rule_error("stop_strings", "not supported yet: stop_strings with num_beams > 1")
        return self
