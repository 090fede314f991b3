"""The stage side of pipeline parallelism: what one stage's forward runs, per model family.

``meshforge.parallel.pipeline.split_model`` swaps a pruned model's class for a subclass with
``_PipelinedCausalLM`` in front: its ``forward(..., pp_stage=i)`` runs only stage ``i``'s part
(embedding on the first stage, its decoder layers, norm and head on the last).
``StageModule`` wraps one stage for torch's ``PipelineStage``.

Each family's inner model builds masks and RoPE tables once before its layers; a stage does the
same for its own layers from the micro-batch's ``position_ids``/``segment_ids`` (tiny next to one
layer's compute), with the preparation its family spec names (``FamilySpec.stage_preparation``:
``meshforge.models.common.stage.decoder_stage`` for the ``DecoderModel`` families, gpt_oss',
qwen3_next's and the transformers path's own ``stage.py``). The preparation gets the pruned
model too (``StageBatch.model``), for state a model keeps outside its inner model.

The MoE router aux loss (see the package docstring): with it on, every stage also
returns a ``carry`` of running aux totals, ``[prob_sum (E), assignments (E), rows]`` over the
MoE layers run so far for this micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from meshforge.models.common.stage import LayerRunner, StageBatch

if TYPE_CHECKING:
    from meshforge.models.common.moe import RouterStats
    from meshforge.parallel.pipeline.layout import StageInfo


def _stage_aux_totals(layers: list[nn.Module], num_experts: int, like: torch.Tensor) -> torch.Tensor | None:
    """``[prob_sum (E), assignments (E), rows]`` summed over the MoE layers just run, or None."""
    stats: list[RouterStats] = [
        found
        for layer in layers
        if (found := getattr(layer.mlp, "last_aux_stats", None)) is not None
        and getattr(layer, "is_moe", True)
    ]
    if not stats:
        return None
    prob_sum = torch.stack([st.prob_sum for st in stats]).sum(0)
    counts = torch.stack([st.assignments.detach().float() for st in stats]).sum(0)
    rows = torch.stack([st.rows.detach().float() for st in stats]).sum().reshape(1)
    out = torch.cat([prob_sum.float(), counts, rows])
    if out.numel() != 2 * num_experts + 1:
        raise RuntimeError(f"pipeline aux carry: expected {num_experts} experts, got {prob_sum.numel()}")
    return out.to(like.device)


def _mtp_states(inner: Any, run: LayerRunner, h: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """The normed hidden states of the MTP blocks after the decoder layers (DeepSeek-V3's ``mtp.py``).

    Depth k reads the embedding of token i + k (the row's last k positions get token 0; they
    have no target) and the previous depth's state; the stage's runner supplies RoPE and mask.
    """
    states = []
    keys = sorted(int(k) for k in inner.layers if int(k) >= inner.num_decoder_layers)
    for depth, key in enumerate(keys, start=1):
        ahead = torch.cat([ids[..., depth:], ids.new_zeros((*ids.shape[:-1], min(depth, ids.shape[-1])))], -1)
        block = functools.partial(inner.layers[str(key)], inner.embed_tokens(ahead))
        h = run(cast(nn.Module, block), h)
        states.append(h)
    return states


class _PipelinedCausalLM:
    """Mixin placed in front of a pruned model's class: the forward of one local stage."""

    # dict[int, StageInfo]; written with Any because transformers' __init_subclass__ resolves the
    # annotations of every base class at runtime, where StageInfo (pipeline.py) is not importable.
    _pp_stages: dict[int, Any]
    # Set by `Pipeline` when the router aux loss is on: routed experts per layer (carry size).
    _pp_aux_experts: int | None = None
    # Set by the Pipeline for kernels.chunk_loss_size: the last stage returns the normed hidden
    # states and the loss applies lm_head chunk by chunk.
    _pp_return_hidden: bool = False

    def forward(
        self,
        inputs: torch.Tensor,
        carry: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        seq_len: int | None = None,
        mtp_ids: torch.Tensor | None = None,
        *,
        pp_stage: int,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run stage ``pp_stage``: embedding (first) -> its layers -> norm and head (last).

        Args:
            inputs: Token ids ``[B, S]`` on the first stage, hidden states ``[B, S, H]`` after.
            carry: With the router aux loss on, the running aux totals from the previous stage
                (``[2E + 1]``; None on the first stage). See the module docstring.
            position_ids, segment_ids: As ``CausalLM.forward``; every stage rebuilds the mask
                and RoPE tables from them (they are tiny next to one layer's compute).
            seq_len: Tokens per row. Needed after the first stage: under sequence parallelism
                the hidden states passed between stages hold only this rank's part of the row.
            mtp_ids: The token ids when the MTP blocks train: the last stage then runs them
                after the final norm and returns ``(logits, mtp logits of depth 1, ...)``.

        Returns:
            The hidden states (logits on the last stage); with the aux loss on, a pair
            ``(hidden or logits, carry)``.
        """
        stage = self._pp_stages[pp_stage]
        inner: Any = self.model  # type: ignore[attr-defined]
        h = inner.embed_tokens(inputs) if stage.is_first else inputs
        if seq_len is None and stage.is_first:
            seq_len = inputs.shape[-1]
        elif seq_len is None:
            from meshforge.parallel.tensor import sequence_shards

            # The mixin always sits in front of an nn.Module class (see pipelined_class).
            seq_len = h.shape[1] * sequence_shards(cast(nn.Module, self))
        layers = [inner.layers[key] for key in stage.layer_keys]
        ids = inputs if stage.is_first else h[..., 0]
        # The mixin always sits in front of an nn.Module class (see pipelined_class).
        model = cast(nn.Module, self)
        run = self._layer_runner(StageBatch(inner, ids, h, position_ids, segment_ids, seq_len, layers, model))
        for layer in layers:
            h = run(layer, h)
        if stage.is_last:
            h = inner.norm(h)
            depths = _mtp_states(inner, run, h, mtp_ids) if mtp_ids is not None else []
            if not self._pp_return_hidden:
                h = self.lm_head(h)  # type: ignore[attr-defined]
                depths = [self.lm_head(state) for state in depths]  # type: ignore[attr-defined]
            if depths:
                return (h, *depths)
        experts = self._pp_aux_experts
        if experts is None:
            return h
        if carry is None:
            # A leaf that requires grad: the stage output always has a graph, even on a first
            # stage without MoE layers (the schedule sends a gradient for every float output).
            carry = torch.zeros(2 * experts + 1, device=h.device, requires_grad=True)
        local = _stage_aux_totals(layers, experts, h)
        return h, (carry + local if local is not None else carry * 1.0)

    # The family's stage preparation (``FamilySpec.stage_preparation``), set by ``pipelined_class``.
    _pp_prepare: ClassVar[Callable[[StageBatch], LayerRunner] | None] = None

    def _layer_runner(self, b: StageBatch) -> LayerRunner:
        """The family's stage preparation for this forward's layers."""
        prepare = type(self)._pp_prepare
        assert prepare is not None, "pipelined_class sets the stage preparation"
        return prepare(b)

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Tie only where this rank holds both ends; otherwise the copies are kept equal by hand.

        The arguments are the model class' own (transformers' ``tie_weights`` takes some).
        """
        inner: Any = self.model  # type: ignore[attr-defined]
        head = self.lm_head  # type: ignore[attr-defined]
        if inner.embed_tokens is not None and head is not None:
            super().tie_weights(*args, **kwargs)  # type: ignore[misc]

    def num_params(self, **kwargs: Any) -> int:
        """Parameters held by this rank (the pruned model; see ``CausalLM.num_params``)."""
        if kwargs.get("exclude_embedding") and self.model.embed_tokens is None:  # type: ignore[attr-defined]
            kwargs["exclude_embedding"] = False
        return super().num_params(**kwargs)  # type: ignore[misc]


class _PipelinedMoECausalLM(_PipelinedCausalLM):
    """The MoE families' ``moe_layers`` on the pruned ModuleDict (keyed by global index)."""

    def moe_layers(self) -> dict[int, nn.Module]:
        """This rank's sparse blocks by global decoder-layer index."""
        layers: Any = self.model.layers  # type: ignore[attr-defined]
        # gpt-oss layers have no `is_moe`: every one of them is sparse.
        return {int(k): layer.mlp for k, layer in layers.items() if getattr(layer, "is_moe", True)}


_PIPELINED_CLASSES: dict[tuple[type, Callable[[StageBatch], LayerRunner]], type] = {}


def pipelined_class(cls: type, prepare: Callable[[StageBatch], LayerRunner]) -> type:
    """``cls`` with the stage forward in front, running ``prepare`` (the family's stage preparation).

    Cached: one subclass per model class. It keeps ``cls``' module, as the wrapper classes of
    ``memory/`` do (transformers' save code looks there for a model's own code).
    """
    key = (cls, prepare)
    if key not in _PIPELINED_CLASSES:
        mixin: type = _PipelinedMoECausalLM if hasattr(cls, "moe_layers") else _PipelinedCausalLM
        body: dict[str, object] = {"__module__": cls.__module__, "_pp_prepare": staticmethod(prepare)}
        _PIPELINED_CLASSES[key] = type(f"Pipelined{cls.__name__}", (mixin, cls), body)
    return _PIPELINED_CLASSES[key]


class StageModule(nn.Module):
    """One local stage as an ``nn.Module`` for ``PipelineStage``.

    Its forward calls the pruned root model (so FSDP's root hooks gather the embedding, norm
    and head) with ``pp_stage`` set; its registered children are the stage's own modules, so
    ``parameters()`` lists what the stage computes with.
    """

    def __init__(self, model: nn.Module, stage: StageInfo) -> None:
        super().__init__()
        self.stage = stage
        self.__dict__["_root"] = model  # not a child: the root belongs to every local stage
        inner: Any = model.model
        self.layers = nn.ModuleDict({k: inner.layers[k] for k in stage.layer_keys})
        if stage.is_first:
            self.embed_tokens = inner.embed_tokens
        if stage.is_last:
            self.norm = inner.norm
            self.lm_head = model.lm_head
            # MTP blocks (and the embedding copy they read) compute on the last stage too.
            count = getattr(inner, "num_decoder_layers", None)
            for key in [k for k in inner.layers if count is not None and int(k) >= count]:
                self.layers[key] = inner.layers[key]
            if count is not None and inner.embed_tokens is not None:
                self.embed_tokens = inner.embed_tokens

    def forward(
        self,
        inputs: torch.Tensor,
        carry: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        seq_len: int | None = None,
        mtp_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids (first stage) or hidden states in, hidden states (or logits, last stage) out.

        With the router aux loss on, the previous stage's ``carry`` comes in second and the
        output is ``(hidden or logits, carry)``; with ``mtp_ids`` the last stage's is
        ``(logits, *mtp_logits)``.
        """
        return self.__dict__["_root"](
            inputs, carry, position_ids, segment_ids, seq_len, mtp_ids, pp_stage=self.stage.index
        )


def router_aux_experts(model: nn.Module) -> int | None:
    """Routed experts per layer when ``model`` has transformers' router aux loss switched on, else None.

    The aux loss exists for the MoE families whose ``aux_loss`` is ``MoECausalLM``'s (not
    deepseek_v3, which has none) and only with ``output_router_logits``, as without pipelining.
    """
    from meshforge.models.common.causal_lm import MoECausalLM

    if (
        not isinstance(model, MoECausalLM)
        or getattr(type(model), "aux_loss", None) is not MoECausalLM.aux_loss
    ):
        return None
    if not getattr(model.args, "output_router_logits", False):
        return None
    return int(model.num_routed_experts)


__all__ = [
    "StageModule",
    "pipelined_class",
    "router_aux_experts",
]
