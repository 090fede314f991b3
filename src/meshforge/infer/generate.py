"""Completing batches of prompts with either backend, and the settings both share.

``Generator`` holds the loaded model and the resolved ``inference:`` options (the section with the
command-line flags applied). ``infer_backend: meshforge`` runs the built-in families' cached decoder
(``engine.decode``, or ``beam.beam_search`` with ``num_beams > 1``); a family without one is named in a log line and goes through transformers, as
does ``infer_backend: huggingface``. Both backends get the same eos / pad ids, the same sampling
filters and a generator seeded with ``inference.seed`` (default ``training.seed``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshforge.infer.beam import BeamOptions, beam_search
from meshforge.infer.engine import DecodeRequest, decode
from meshforge.infer.kv_cache import cache_support
from meshforge.infer.sampling import SamplingOptions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.infer.config import InferenceConfig
    from meshforge.infer.load import GenerationModel

Log = Callable[[str], None]


def _transformers_builds(family: str) -> bool:
    """Whether transformers has a causal LM of this family (the generic path is transformers' own).

    The causal-LM table, not the config table: transformers 5.24 names ``step3p5`` among its
    configs (a vision model's text part) but builds no ``Step3p5ForCausalLM``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from meshforge.models.spec import GENERIC

    return family == GENERIC or family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@dataclass(frozen=True)
class Completion:
    """One generated completion: its text (cut before a stop string) and every generated token."""

    text: str
    token_ids: list[int]


def _generation_ids(hf_dir: Path | None, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], int | None]:
    """eos ids and pad id: generation_config.json, then config.json, then the tokenizer."""
    eos: list[int] = []
    pad: int | None = None
    for name in ("generation_config.json", "config.json"):
        file = hf_dir / name if hf_dir is not None else None
        if file is None or not file.is_file():
            continue
        data = json.loads(file.read_text())
        value = data.get("eos_token_id")
        if value is not None and not eos:
            eos = [value] if isinstance(value, int) else [int(v) for v in value]
        if pad is None and isinstance(data.get("pad_token_id"), int):
            pad = data["pad_token_id"]
    if not eos and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    if tokenizer.pad_token_id is not None:
        pad = int(tokenizer.pad_token_id)
    return eos, pad


def context_length(model: nn.Module) -> int | None:
    """The model's longest sequence (``max_position_embeddings``), when its config gives one."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


class Generator:
    """Completes prompts (token ids) with the configured backend.

    Args:
        loaded: The model, tokenizer and weight source.
        options: The resolved ``inference:`` section.
        seed: Sampling seed.
        log: Progress and fallback lines (rank 0 prints them).
    """

    def __init__(self, loaded: GenerationModel, options: InferenceConfig, *, seed: int, log: Log) -> None:
        from meshforge.infer.load import as_transformers, shard_for_generation

        self.loaded = loaded
        self.options = options
        self.tokenizer = loaded.tokenizer
        eos, pad = _generation_ids(loaded.hf_dir, loaded.tokenizer)
        self.eos = tuple(options.eos_token_id) if options.eos_token_id is not None else tuple(eos)
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.backend = options.infer_backend
        self.use_kv_cache = options.use_kv_cache
        own_only = not _transformers_builds(loaded.family.name)
        if self.backend == "huggingface" and own_only:
            log(f"generate: transformers has no {loaded.family.name} model; meshforge's decoder generates")
            self.backend = "meshforge"
        if self.backend == "meshforge":
            reason = cache_support(loaded.model)
            if reason is not None and own_only:
                if self.use_kv_cache:
                    log(
                        f"generate: {reason}; every step runs the whole sequence (as inference.use_kv_cache: false)"
                    )
                self.use_kv_cache = False
            elif reason is not None:
                log(f"generate: infer_backend meshforge: {reason}; using transformers' generate instead")
                self.backend = "huggingface"
        self.model = loaded.model if self.backend == "meshforge" else as_transformers(loaded, log)
        # Only the model that generates stays alive (the built-in one was the export's source).
        loaded.model = self.model
        self.context = context_length(self.model)
        shard_for_generation(self.model, log)
        self.device = next(self.model.parameters()).device
        self.sampling = SamplingOptions(
            do_sample=options.do_sample,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            repetition_penalty=options.repetition_penalty,
        )
        self.beams = options.num_beams or 1
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.log = log

    def check_lengths(self, prompts: Sequence[Sequence[int]], sources: Sequence[str]) -> int:
        """The new-token limit for these prompts (capped at the context), or an error naming a prompt.

        Raises:
            ValueError: When a prompt alone fills the model's context.
        """
        limit = self.options.max_new_tokens
        if self.context is None:
            return limit
        for ids, source in zip(prompts, sources, strict=True):
            if len(ids) >= self.context:
                raise ValueError(
                    f"{source}: the prompt has {len(ids)} tokens and the model's context "
                    f"(max_position_embeddings) is {self.context}; shorten it"
                )
        room = self.context - max(len(p) for p in prompts)
        if room < limit:
            self.log(
                f"generate: inference.max_new_tokens {limit} capped at {room} (context {self.context} "
                f"minus the longest prompt)"
            )
        return min(limit, room)

    def _stop(self) -> Callable[[list[int]], bool] | None:
        strings = self.options.stop_strings
        if not strings:
            return None
        return lambda ids: any(s in self.tokenizer.decode(ids) for s in strings)

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        sources: Sequence[str],
        on_token: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Completions of one batch of tokenised prompts."""
        max_new = self.check_lengths(prompts, sources)
        if self.backend == "meshforge":
            request = DecodeRequest(prompts, max_new, self.pad, self.eos, self.use_kv_cache)
            if self.beams > 1:
                beam = BeamOptions(
                    self.beams,
                    self.options.length_penalty,
                    self.options.early_stopping,
                    self.options.repetition_penalty,
                )
                return [self._completion(ids) for ids in beam_search(self.model, request, beam)]
            rows = decode(
                self.model,
                request,
                self.sampling,
                generator=self.generator,
                stop=self._stop(),
                on_token=on_token,
            )
        else:
            rows = self._hf_generate(prompts, max_new)
        return [self._completion(ids) for ids in rows]

    def _completion(self, ids: list[int]) -> Completion:
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        for stop in self.options.stop_strings:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        return Completion(text, ids)

    @torch.no_grad()
    def _hf_generate(self, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
        from transformers import LogitsProcessorList

        from meshforge.infer.engine import left_pad
        from meshforge.infer.sampling import agree_across_ranks

        ids, mask = left_pad(prompts, self.pad, self.device)
        kwargs: dict[str, object] = {}
        if self.sampling.do_sample:
            kwargs = {
                "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k,
                "top_p": self.sampling.top_p,
            }
            torch.manual_seed(self.seed)
            self.seed += 1  # the next batch draws new numbers, as the own path's generator does
        if self.beams > 1:
            kwargs |= {
                "num_beams": self.beams,
                "length_penalty": self.options.length_penalty,
                "early_stopping": self.options.early_stopping,
            }
        if self.options.stop_strings:
            kwargs |= {"stop_strings": list(self.options.stop_strings), "tokenizer": self.tokenizer}
        world = dist.get_world_size() if dist.is_initialized() else 1

        def agree(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return agree_across_ranks(scores.contiguous())

        out = self.model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=max_new,
            do_sample=self.sampling.do_sample,
            repetition_penalty=self.sampling.repetition_penalty,
            eos_token_id=list(self.eos) or None,
            pad_token_id=self.pad,
            use_cache=self.options.use_kv_cache,
            synced_gpus=world > 1,
            logits_processor=LogitsProcessorList([agree]) if world > 1 else None,
            **kwargs,
        )
        rows = []
        for row in out[:, ids.shape[1] :].tolist():
            kept: list[int] = []
            for token in row:
                kept.append(token)
                if token in self.eos:
                    break
            else:
                # A row that ended on a stop string is padded to the batch's length.
                while self.options.stop_strings and kept and kept[-1] == self.pad:
                    kept.pop()
            rows.append(kept)
        return rows
