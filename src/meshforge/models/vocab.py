"""Grow a model's vocabulary for an extended tokenizer, and initialise the new embedding rows.

LLaMA-Factory (and MindSpeed-LLM, which takes its arguments) resizes a model whose tokenizer
outgrew it with ``resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)`` and then fills
every new row of the input embedding (and of an untied LM head) by ``init_special_tokens``:

- ``noise_init``: the mean of the old rows plus Gaussian noise of std ``1/sqrt(hidden)``;
- ``desc_init``: for each described token, the mean of the input-embedding rows of its
  description's tokens (tokenised without special tokens; tokens that have no old row are left
  out; an empty result falls back to the mean of the old rows);
- ``desc_init_w_noise``: the same plus the noise above.

meshforge resizes before building instead of after loading: the model is built on the meta device
with the padded size (`vocab_plan` says which), a Hugging Face checkpoint with the old number of
rows loads into the first rows (`meshforge.checkpoint.hf.load_hf_weights(..., vocab_plan=plan)`),
and `init_new_rows` fills the rest, on plain tensors and on FSDP/TP DTensors alike: every rank
gathers the full table (one parameter at a time, as loading does), computes the same new rows
from a seeded generator and keeps its own shard.

Where LLaMA-Factory 0.9.5 is inconsistent, this module does what it means to do:
- a description's row is the described token's own id (LLaMA-Factory writes description ``i`` to
  row ``old_rows + i``, the same thing whenever the tokenizer had exactly ``old_rows`` tokens);
- description tokens are kept when their id is below ``old_rows`` (LLaMA-Factory's filter
  ``id < len(tokenizer) - num_new_rows`` also drops some old ids once padding rows exist);
- in the ``desc_*`` modes the new rows without a description (padding, ordinary added tokens)
  get the mean of the old rows, what transformers' ``mean_resizing`` gives them up to its
  1e-9-scaled covariance noise;
- the noise comes from a generator seeded by (seed, table: embedding or head), so a run is
  reproducible and every rank draws the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from meshforge.models.materialize import parameter_seed

InitMode = Literal["noise_init", "desc_init", "desc_init_w_noise"]
INIT_MODES: tuple[str, ...] = ("noise_init", "desc_init", "desc_init_w_noise")
PAD_TO_MULTIPLE_OF = 64  # LLaMA-Factory's resize_token_embeddings(..., pad_to_multiple_of=64)


@dataclass(frozen=True)
class VocabPlan:
    """How many embedding rows the model gets, and what the new ones stand for.

    Attributes:
        old_vocab_size: rows the model config (and its checkpoint) has.
        new_vocab_size: rows to build: ``old_vocab_size``, or ``len(tokenizer)`` rounded up to a
            multiple of 64 when the vocabulary is resized.
        tokenizer_size: ``len(tokenizer)``.
        added_ids: ids of the tokens the tokenizer extension added (may lie below
            ``old_vocab_size`` when the model already had spare rows: those keep their rows).
        descriptions: token id -> description, for the described tokens whose row is new.
    """

    old_vocab_size: int
    new_vocab_size: int
    tokenizer_size: int
    added_ids: tuple[int, ...] = ()
    descriptions: dict[int, str] = field(default_factory=dict)

    @property
    def resized(self) -> bool:
        """True when the model gets more rows than its config says."""
        return self.new_vocab_size > self.old_vocab_size

    @property
    def num_new_rows(self) -> int:
        return self.new_vocab_size - self.old_vocab_size

    def model_options(self, options: dict[str, object]) -> dict[str, object]:
        """``options`` (the family's ``model:`` options) with ``vocab_size`` set to the new size."""
        return {**options, "vocab_size": self.new_vocab_size} if self.resized else dict(options)


def padded_size(size: int, multiple: int = PAD_TO_MULTIPLE_OF) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (as transformers' ``pad_to_multiple_of``)."""
    return -(-size // multiple) * multiple


#: The attribute under which ``meshforge.data.tokenizer.extend_tokenizer`` leaves its record of
#: the added tokens on the tokenizer (read when no ``added`` is passed to ``vocab_plan``).
ADDED_TOKENS_ATTR = "meshforge_extension"


@runtime_checkable
class AddedTokens(Protocol):
    """What a tokenizer extension added (``meshforge.data.tokenizer.TokenizerExtension`` is one).

    Attributes:
        num_added: Tokens the extension added to the vocabulary.
        requested: Whether the configuration asked for tokens (resizing is then implied).
        new_ids: Added token -> its id.
        descriptions: Added token -> the text its embedding row starts from (``desc_init``).
    """

    @property
    def num_added(self) -> int: ...

    @property
    def requested(self) -> bool: ...

    @property
    def new_ids(self) -> Mapping[str, int]: ...

    @property
    def descriptions(self) -> Mapping[str, str]: ...


class _NothingAdded:
    num_added = 0
    requested = False
    new_ids: Mapping[str, int] = MappingProxyType({})
    descriptions: Mapping[str, str] = MappingProxyType({})


def _added_tokens(tokenizer: Any) -> AddedTokens:
    found = getattr(tokenizer, ADDED_TOKENS_ATTR, None)
    return found if isinstance(found, AddedTokens) else _NothingAdded()


def vocab_plan(
    tokenizer: Any,
    model_vocab_size: int,
    *,
    resize_vocab: bool,
    added: AddedTokens | None = None,
    pad_to_multiple_of: int = PAD_TO_MULTIPLE_OF,
    log: Callable[[str], None] | None = None,
) -> VocabPlan:
    """Decide the model's vocabulary size for ``tokenizer``.

    The vocabulary grows when the tokenizer has more tokens than the model has rows and either
    ``resize_vocab`` is set or the tokenizer extension asked for tokens (LLaMA-Factory turns
    ``resize_vocab`` on then). A tokenizer that fits leaves the model as it is, even with
    ``resize_vocab`` (added tokens then use the model's spare rows, untouched, as LLaMA-Factory).

    Args:
        tokenizer: the (extended) Hugging Face tokenizer (see ``meshforge.data.tokenizer``).
        model_vocab_size: ``vocab_size`` of the model config (``model:`` section / config.json).
        resize_vocab: ``model.resize_vocab``.
        added: What the tokenizer extension added; None reads the record the extension left on
            ``tokenizer`` (``ADDED_TOKENS_ATTR``; none: nothing was added).
        pad_to_multiple_of: row-count granularity of a resized vocabulary.
        log: sink for one line when the vocabulary is resized.

    Raises:
        ValueError: when the tokenizer has more tokens than the model and resizing is off.
    """
    extension = added if added is not None else _added_tokens(tokenizer)
    size = len(tokenizer)
    old = int(model_vocab_size)
    if size <= old:
        if extension.num_added and log is not None:
            log(
                f"model: the tokenizer's {size} tokens fit the model's {old} rows; the {extension.num_added} "
                "added tokens use existing rows as they are (no resize, no init_special_tokens)"
            )
        return VocabPlan(old, old, size, tuple(extension.new_ids.values()))
    if not (resize_vocab or extension.requested):
        raise ValueError(
            f"model.vocab_size: {old} is smaller than the tokenizer's {size} tokens; set "
            "model.resize_vocab: true to grow the embedding (and an untied LM head) to fit"
        )
    new = padded_size(size, pad_to_multiple_of)
    descriptions = {
        extension.new_ids[token]: text
        for token, text in extension.descriptions.items()
        if extension.new_ids.get(token, -1) >= old
    }
    plan = VocabPlan(old, new, size, tuple(extension.new_ids.values()), descriptions)
    if log is not None:
        log(
            f"model: vocabulary resized {old} -> {new} rows for the tokenizer's {size} tokens "
            f"(padded to a multiple of {pad_to_multiple_of}); {plan.num_new_rows} new rows"
        )
    return plan


def _module_weight(model: nn.Module, getter: str, fallback: str) -> nn.Parameter | None:
    get = getattr(model, getter, None)
    module = get() if callable(get) else None
    if module is None:
        module = model
        for part in fallback.split("."):
            module = getattr(module, part, None)
            if module is None:
                return None
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, nn.Parameter) else None


def vocab_parameters(model: nn.Module) -> dict[str, str]:
    """Parameter name -> ``"embedding"`` / ``"lm_head"`` for the vocabulary-sized weights.

    The input embedding and the output head (``get_input_embeddings`` /
    ``get_output_embeddings`` when the model has them, else ``model.embed_tokens`` and
    ``lm_head``); a head tied to the embedding is listed once, as the embedding.
    """
    embedding = _module_weight(model, "get_input_embeddings", "model.embed_tokens")
    head = _module_weight(model, "get_output_embeddings", "lm_head")
    out: dict[str, str] = {}
    for name, param in model.named_parameters():  # remove_duplicate: a tied head is not listed
        if param is embedding:
            out[name] = "embedding"
        elif param is head:
            out[name] = "lm_head"
    return out


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective for a DTensor: every rank must call it)."""
    data = param.detach()
    return data.full_tensor() if isinstance(data, DTensor) else data


def write_rows(param: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Write ``rows`` into ``param[start:start + len(rows)]`` in place, leaving the other rows alone.

    Args:
        param: a plain tensor or a DTensor (any placements); for a DTensor each rank writes only
            the part of ``rows`` its local shard holds (no communication).
        start: first row written.
        rows: the full rows (all columns), on every rank alike.
    """
    if not isinstance(param, DTensor):
        param.data[start : start + rows.shape[0]].copy_(rows)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if local.numel() == 0:
        return
    # The rows of the full tensor this rank holds, intersected with the rows being written.
    lo, hi = max(offset[0], start), min(offset[0] + local_shape[0], start + rows.shape[0])
    if lo >= hi:
        return
    index = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:], strict=True))
    part = rows[(slice(lo - start, hi - start), *index)]
    local[lo - offset[0] : hi - offset[0]].copy_(part.to(local.dtype))


def _description_means(
    embedding: torch.Tensor, plan: VocabPlan, tokenizer: Any, emit: Callable[[str], None]
) -> dict[int, torch.Tensor]:
    """Token id -> mean input-embedding row of its description's tokens (float32)."""
    means: dict[int, torch.Tensor] = {}
    for token_id, text in plan.descriptions.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        valid = [i for i in ids if i < plan.old_vocab_size]
        if not valid:
            emit(
                f"warning: the description of token id {token_id} ({text!r}) has no token with an old "
                "embedding row; its row gets the mean of the old rows"
            )
            continue
        index = torch.tensor(valid, dtype=torch.long, device=embedding.device)
        means[token_id] = embedding.index_select(0, index).float().mean(dim=0)
    return means


@torch.no_grad()
def new_rows(
    full: torch.Tensor,
    plan: VocabPlan,
    mode: str,
    *,
    generator: torch.Generator,
    description_means: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ``plan.num_new_rows`` new rows of one vocabulary table, computed from its old rows.

    Args:
        full: the whole table ``[new_vocab_size, hidden]`` (only its first ``old_vocab_size``
            rows are read).
        plan: the vocabulary plan.
        mode: ``noise_init``, ``desc_init`` or ``desc_init_w_noise``.
        generator: CPU generator for the noise (``1/sqrt(hidden)`` std).
        description_means: token id -> description mean (the ``desc_*`` modes).

    Returns:
        A float32 tensor ``[num_new_rows, hidden]`` on ``full``'s device.
    """
    old, hidden = plan.old_vocab_size, full.shape[1]
    mean = full[:old].float().mean(dim=0, keepdim=True)
    rows = mean.expand(plan.num_new_rows, hidden).clone()
    noise_std = 1.0 / math.sqrt(hidden)
    if mode == "noise_init":
        noise = torch.empty(plan.num_new_rows, hidden, dtype=torch.float32)
        noise.normal_(0.0, noise_std, generator=generator)
        return rows + noise.to(rows.device)
    for token_id, value in sorted((description_means or {}).items()):
        row = value.to(rows.device)
        if mode == "desc_init_w_noise":
            noise = torch.empty(hidden, dtype=torch.float32).normal_(0.0, noise_std, generator=generator)
            row = row + noise.to(rows.device)
        rows[token_id - old] = row
    return rows


@torch.no_grad()
def init_new_rows(
    model: nn.Module,
    plan: VocabPlan,
    tokenizer: Any,
    mode: str,
    seed: int,
    *,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Fill the new rows of the input embedding and of an untied LM head, in place.

    Collective on sharded models (every rank must call it): each vocabulary table is gathered in
    full, its new rows computed identically on every rank and each rank writes its own part. The
    old rows are not changed. A no-op when ``plan`` does not resize.

    Args:
        model: built with ``plan.new_vocab_size`` rows and materialised (old rows loaded).
        plan: from `vocab_plan`.
        tokenizer: the extended tokenizer (tokenises the descriptions of the ``desc_*`` modes).
        mode: ``model.init_special_tokens``; a ``desc_*`` mode without descriptions falls back to
            ``noise_init`` with a logged warning, as LLaMA-Factory does.
        seed: ``training.seed``; the noise of each table comes from (seed, its role: embedding or
            head), the same on every rank and in every parallel layout.
        log: sink for a summary line and warnings.

    Returns:
        The names of the parameters whose rows were written.

    Raises:
        ValueError: for an unknown ``mode`` or a model whose tables do not have the plan's size.
    """
    emit = log or (lambda _msg: None)
    if mode not in INIT_MODES:
        raise ValueError(f"model.init_special_tokens: {mode!r} is not one of {', '.join(INIT_MODES)}")
    if not plan.resized:
        return []
    if mode != "noise_init" and not plan.descriptions:
        emit(
            f"warning: model.init_special_tokens: {mode} needs model.new_special_tokens_config "
            "(descriptions of new tokens); using noise_init"
        )
        mode = "noise_init"
    tables = vocab_parameters(model)
    if not tables:
        return []  # a pipeline stage with neither the embedding nor the head
    if mode != "noise_init" and "embedding" not in tables.values():
        raise ValueError(
            f"model.init_special_tokens: {mode} reads the input embedding, which this rank does not hold "
            "(pipeline stages split the embedding from the LM head); use noise_init"
        )
    params = dict(model.named_parameters())
    for name in tables:
        if params[name].shape[0] != plan.new_vocab_size:
            raise ValueError(
                f"init_new_rows: {name} has {params[name].shape[0]} rows but the vocabulary plan "
                f"says {plan.new_vocab_size}; build the model with plan.model_options(options)"
            )
    # A tied head kept as its own copy (the last pipeline stage) must get the embedding's rows.
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    means: dict[int, torch.Tensor] | None = None
    # The embedding first: the head's description rows are means of input-embedding rows.
    for name in sorted(tables, key=lambda n: tables[n] != "embedding"):
        param = params[name]
        full = _full(param)
        if mode != "noise_init" and means is None:
            means = _description_means(full, plan, tokenizer, emit)
        role = "embedding" if tied else tables[name]
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, f"{role}:new_rows"))
        rows = new_rows(full, plan, mode, generator=generator, description_means=means)
        write_rows(param, plan.old_vocab_size, rows)
        del full
    emit(
        f"model: initialised {plan.num_new_rows} new vocabulary rows of {', '.join(tables)} by {mode}"
        + (f" ({len(plan.descriptions)} described tokens)" if mode != "noise_init" else "")
    )
    return list(tables)
