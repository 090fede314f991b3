"""The causal-LM wrapper every built-in family shares: inner model, LM head, tying, init.

Each family's ``*ForCausalLM`` is transformers' module tree (``model`` then
``lm_head``), and apart from the decoder itself they all behave the same: the head is
tied to the embedding when ``tie_word_embeddings`` (and re-tied after every
``_apply``), the forward runs the inner model and then the head (or stops at the
hidden states for the chunked loss), kernel switches go through
``apply_kernel_options``, and parameters are initialised one by one as transformers'
``_init_weights`` does. ``CausalLM`` holds that once; a family sets its names and
the parameter suffixes of its own initialisation rules. ``MoECausalLM`` adds the
routing statistics and active-parameter count of the sparse families, and
``DecoderModel`` is the inner ``model`` forward of the families whose layers all
take one mask (embedding, per-document mask and positions, RoPE, layers, norm).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

import torch
from torch import nn

from meshforge.models.common.attention import positions_from_segments, segment_causal_mask
from meshforge.models.common.kernels import KernelOptions, apply_kernel_options
from meshforge.models.common.moe import ExpertsBase, RouterStats, load_balancing_loss

if TYPE_CHECKING:
    from meshforge.models.spec import CPPlan


class CausalLMArgs(Protocol):
    """The fields of a family's ``*Args`` that ``CausalLM`` reads (read-only: the dataclasses are frozen)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def initializer_range(self) -> float: ...
    @property
    def pad_token_id(self) -> int | None: ...


class MoECausalLMArgs(CausalLMArgs, Protocol):
    """The further fields ``MoECausalLM`` reads."""

    @property
    def output_router_logits(self) -> bool: ...
    @property
    def num_experts_per_tok(self) -> int: ...


class RoutedBlock(Protocol):
    """What ``MoECausalLM`` reads from a sparse block after a forward."""

    @property
    def experts(self) -> ExpertsBase: ...
    @property
    def last_tokens_per_expert(self) -> torch.Tensor | None: ...
    @property
    def last_aux_stats(self) -> RouterStats | None: ...


ArgsT = TypeVar("ArgsT", bound=CausalLMArgs)
MoEArgsT = TypeVar("MoEArgsT", bound=MoECausalLMArgs)
InitKind = Literal["normal", "norm", "zero"]

# Weights that are normal(0, initializer_range) in every family, whatever their suffix.
_HEAD_AND_EMBEDDING = ("lm_head.weight", "model.embed_tokens.weight")


class InnerModel(nn.Module):
    """The attributes every family's inner ``model`` creates (the layout of transformers' ``*Model``)."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module


class DecoderModel(InnerModel):
    """Forward of transformers' inner ``*Model``: embedding, decoder layers, final norm.

    A subclass creates ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb`` (in
    that order, as transformers does) in its ``__init__``; every layer is called as
    ``layer(h, rope, mask)``, or ``layer(h, rope, mask, token_mask)`` when
    ``pass_token_mask`` (MoE layers that leave padding out of the aux loss). Under
    context parallelism (``cp`` set by ``meshforge.parallel.context.apply_cp``) ``mask``
    is the CP plan's mask object and ``position_ids`` are the global positions.
    """

    pass_token_mask: ClassVar[bool] = False
    # Set by meshforge.parallel.context.apply_cp: builds the per-forward CP mask object
    # (and global positions) instead of the local [S, S] mask; None without CP.
    cp: CPPlan | None = None
    # Set by meshforge.infer.kv_cache during cached generation: a callable giving the boolean
    # mask [B, 1, S_new, S_total] of this forward's queries over every cached key (or None: no
    # padding, nothing to mask); the hook itself is None in training.
    decode_mask: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # A boolean mask tensor, None (plain causal) or the CP plan's own mask object.
        mask: torch.Tensor | object = None
        token_mask = None
        if self.decode_mask is not None:
            mask = self.decode_mask(input_ids)
        elif self.cp is not None:
            # Context parallel: this rank holds a slice of each row. The CP plan gathers
            # what it needs about the full row once per forward (document ids, global
            # positions) and every layer's attention reads it from the mask object.
            mask, position_ids = self.cp.prepare(input_ids, position_ids, segment_ids)
            if self.pass_token_mask and segment_ids is not None:
                token_mask = segment_ids != 0
        elif segment_ids is not None:
            # One mask for all layers; positions restart per document unless given.
            mask = segment_causal_mask(segment_ids)
            if self.pass_token_mask:
                token_mask = segment_ids != 0
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
        rope = self.rotary_emb(position_ids, seq_len=input_ids.shape[-1], device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask, token_mask) if self.pass_token_mask else layer(h, rope, mask)
        return self.norm(h)


class CausalLM(nn.Module, Generic[ArgsT]):
    """Inner decoder ``model`` plus ``lm_head``, as transformers' ``*ForCausalLM``.

    Subclasses set ``family`` (the kernel-switch family name), ``display_name`` (used
    in error messages) and, where their parameters need it, the init suffix tuples;
    ``_init_kind`` and ``_init_error`` are the hooks for anything a suffix cannot say.

    Args:
        args: Structural hyper-parameters (the family's ``*Args``; needs
            ``hidden_size``, ``vocab_size``, ``tie_word_embeddings``,
            ``initializer_range`` and ``pad_token_id``).
        model: The inner decoder (embedding ``embed_tokens``, layers, final norm),
            built before the head so parameter creation order is the transformers one.
    """

    family: ClassVar[str]
    display_name: ClassVar[str]
    # Suffixes of parameters initialised normal(0, initializer_range), 1 and 0; checked
    # in that order (so a normal-initialised bias can be listed before the ``.bias`` rule).
    init_normal_suffixes: ClassVar[tuple[str, ...]] = ("_proj.weight",)
    init_norm_suffixes: ClassVar[tuple[str, ...]] = ("norm.weight",)
    init_zero_suffixes: ClassVar[tuple[str, ...]] = (".bias",)

    def __init__(self, args: ArgsT, model: InnerModel) -> None:
        super().__init__()
        self.args = args
        self.model = model
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    @property
    def config(self) -> ArgsT:
        """The structural arguments under transformers' attribute name (``model.config.vocab_size``)."""
        return self.args

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding's parameter when ``tie_word_embeddings``.

        One tensor under two names, as transformers ties them. A no-op when already
        tied. Called again after every ``_apply`` because ``to_empty`` (and ``to``) from
        the meta device gives each module its own new parameter, silently untying.
        """
        if self.args.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Compute next-token logits (MoE families also record this forward's routing).

        Args:
            input_ids: Token ids ``[B, S]``.
            position_ids: Optional positions ``[B, S]``; default ``0..S-1``, or restarting
                at 0 per segment when ``segment_ids`` is given.
            segment_ids: Optional ``[B, S]`` document ids of packed rows (0 = padding);
                attention never crosses a segment boundary (sliding windows are cut there
                too) and padding is left out of any router aux loss.
            return_hidden: Return the final normed hidden states ``[B, S, hidden]``
                instead of the logits (for the chunked loss).

        Returns:
            Logits ``[B, S, vocab_size]`` in the compute dtype.
        """
        hidden = self.model(input_ids, position_ids, segment_ids)
        # The chunked loss (kernels.chunk_loss_size) applies lm_head itself, chunk by chunk.
        return hidden if return_hidden else self.lm_head(hidden)

    def configure_kernels(self, options: KernelOptions) -> None:
        """Apply the kernel switches (``meshforge.models.common.kernels``) to the blocks."""
        apply_kernel_options(self, options, family=self.family)

    def _init_kind(self, fqn: str) -> InitKind | None:
        """How ``fqn`` is initialised, or None when it is no parameter name of this family."""
        if fqn in _HEAD_AND_EMBEDDING or fqn.endswith(self.init_normal_suffixes):
            return "normal"
        if fqn.endswith(self.init_norm_suffixes):
            return "norm"
        if fqn.endswith(self.init_zero_suffixes):
            return "zero"
        return None

    def _init_error(self, fqn: str) -> str:
        """The message for a name ``_init_kind`` does not know."""
        return f"init_full_parameter_: not a {self.display_name} parameter name: {fqn!r}"

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Initialise one full (unsharded) parameter in place, as transformers does.

        Linear and embedding weights (and the family's other ``init_normal_suffixes``,
        e.g. experts, routers, sinks) ~ normal(0, ``initializer_range``), the padding
        row of the embedding zeroed when ``pad_token_id`` is set; norm weights = 1;
        biases (and the other ``init_zero_suffixes``) = 0. Randomness comes only from
        ``generator``, so a trainer that seeds one generator per parameter and keeps
        its local shard gets the weights a single process would.

        Args:
            fqn: Fully-qualified parameter name, e.g. ``model.layers.0.mlp.up_proj.weight``.
            tensor: The full parameter tensor (on the generator's device), written in place.
            generator: Source of randomness.

        Raises:
            ValueError: If ``fqn`` is not a parameter name of this model.
        """
        kind = self._init_kind(fqn)
        if kind is None:
            raise ValueError(self._init_error(fqn))
        with torch.no_grad():
            if kind == "zero":
                tensor.zero_()
            elif kind == "norm":
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, self.args.initializer_range, generator=generator)
                pad = self.args.pad_token_id
                if fqn == "model.embed_tokens.weight" and pad is not None:
                    tensor[pad].zero_()

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Count of distinct parameters (a tied head counted once).

        Args:
            exclude_embedding: Leave out the input embedding table.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.model.embed_tokens.weight.numel()
        return total


class MoECausalLM(CausalLM[MoEArgsT]):
    """``CausalLM`` of a family with routed experts: routing statistics and active parameters.

    Subclasses implement ``moe_layers`` and ``num_routed_experts``; ``_expert_numel``
    says which expert parameters ``num_params(active=True)`` scales down.
    """

    def moe_layers(self) -> Mapping[int, RoutedBlock]:
        """The sparse blocks by decoder-layer index."""
        raise NotImplementedError

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer (the family's own field name for it)."""
        raise NotImplementedError

    def _expert_numel(self, block: RoutedBlock) -> int:
        """Parameters of ``block``'s routed experts that a token uses only k of E of."""
        return block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()

    def aux_loss(self) -> torch.Tensor | None:
        """Router load-balancing loss of the last forward, unscaled (float32 scalar).

        Follows transformers: the loss exists only when ``output_router_logits`` is
        true, and it is one Switch loss over all MoE layers together. The trainer adds
        ``router_aux_loss_coef * aux_loss()``.

        Returns:
            The loss, or None when ``output_router_logits`` is false, the model has no
            MoE layer, or no forward ran yet.
        """
        if not self.args.output_router_logits:
            return None
        stats = [block.last_aux_stats for block in self.moe_layers().values()]
        recorded = [s for s in stats if s is not None]
        if len(recorded) != len(stats):
            return None
        return load_balancing_loss(recorded, self.num_routed_experts)

    def tokens_per_expert(self) -> dict[int, torch.Tensor]:
        """Top-k assignments per expert in the last forward: layer index -> LongTensor ``[experts]``.

        Every token is counted (padding too), so each layer's counts sum to
        ``tokens * num_experts_per_tok``. Layers that have not run are left out.
        """
        counts = {i: block.last_tokens_per_expert for i, block in self.moe_layers().items()}
        return {i: c for i, c in counts.items() if c is not None}

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        """Count of distinct parameters (a tied head counted once).

        Args:
            exclude_embedding: Leave out the input embedding table.
            active: Count only what one token uses: ``num_experts_per_tok`` of the
                routed experts per MoE layer.
        """
        total = super().num_params(exclude_embedding=exclude_embedding)
        if active:
            n, k = self.num_routed_experts, self.args.num_experts_per_tok
            for block in self.moe_layers().values():
                total -= self._expert_numel(block) * (n - k) // n
        return total


ModelT = TypeVar("ModelT", bound=CausalLM[Any])


def build_causal_lm(cls: Callable[[Any], ModelT], args: Any, device: str | torch.device = "meta") -> ModelT:
    """Construct ``cls(args)`` on ``device`` (meta: no memory, weights come later).

    On a real device the parameters are initialised right away, parameter ``i`` of
    ``named_parameters`` from a generator seeded with ``i``.
    """
    with torch.device(device):
        model = cls(args)
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device)
        for i, (name, param) in enumerate(model.named_parameters()):
            generator.manual_seed(i)
            model.init_full_parameter_(name, param.data, generator)
    return model


__all__ = [
    "CausalLM",
    "CausalLMArgs",
    "DecoderModel",
    "InnerModel",
    "MoECausalLM",
    "MoECausalLMArgs",
    "RoutedBlock",
    "build_causal_lm",
]
