"""The contract between a model family and the rest of meshforge: one ``FamilySpec`` per family.

Code outside ``models/`` (the trainer, ``parallel/``, ``checkpoint/``) reaches a family only
through its spec, found by the registry (``meshforge.models.registry``). The spec is light:
names, option keys and the options parser (``args.py`` imports no torch) are plain fields, and
every heavy piece is a function of the family's ``spec.py`` that imports its module when called
(the model class, the TP plan, the pipeline stage preparation, the CP modules, the KV-cache
modules, the expert type, the HF adapter; ``models/common/family_parts.py`` makes them from
module paths). So resolving a family from a config never imports torch, and ``parallel/``
never imports ``models/<family>``: it calls these functions.

The protocols below say what each piece must do; ``models/common`` has the shared
implementations (``hf_adapter.HFAdapterBase``, ``stage.decoder_stage``, ``tp_plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from meshforge.models.common.model_args import ModelArgs

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.moe import TokenExchange
    from meshforge.models.common.stage import LayerRunner, StageBatch

#: ``model_type`` of the generic transformers path (any ``AutoModelForCausalLM`` from a folder).
GENERIC = "generic"


class HFStateDictAdapter(Protocol):
    """A family's mapping between its parameters and the keys transformers writes to safetensors.

    ``meshforge.models.common.hf_adapter.HFAdapterBase`` implements the identity mapping (names
    are the HF keys, one tensor each); families whose checkpoints differ subclass it.
    """

    @property
    def architecture(self) -> str:
        """The transformers class written to ``config.json``'s ``architectures``."""
        ...

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """``fnmatch`` patterns of checkpoint keys the model does not need."""
        ...

    @property
    def renames_only(self) -> bool:
        """True when every parameter is one HF tensor of the same layout (slices can be read)."""
        ...

    def hf_sources(self, name: str) -> list[str]:
        """The HF keys needed to build parameter ``name``."""
        ...

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Parameter ``name`` (full) from the tensors of ``hf_sources(name)``."""
        ...

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF key -> tensor for one full parameter (the inverse of ``from_hf``)."""
        ...

    def to_hf_config(self, args: ModelArgs) -> dict[str, object]:
        """The ``config.json`` body for ``args`` (``model_type`` and ``architectures`` included)."""
        ...

    def from_hf_config(self, config: Mapping[str, object]) -> dict[str, object]:
        """``model:`` options from a ``config.json`` body."""
        ...


class TPPlan(Protocol):
    """A family's tensor-parallel plan: ``{module path: ParallelStyle}`` for a model or a stage.

    Raises ``ValueError`` naming the ``model.*`` key when a size it splits is not a multiple of
    ``tp``.
    """

    def __call__(
        self, model: nn.Module, *, tp: int, sequence_parallel: bool, loss_parallel: bool
    ) -> dict[str, ParallelStyle]: ...


class PatternTPPlan(Protocol):
    """A tensor-parallel plan from the modules ``parallelism.tp_colwise`` / ``tp_rowwise`` match.

    For a family whose module tree meshforge does not write (the transformers path): ``parallel/``
    matches the patterns (errors name the key) and the plan turns the matched modules into
    styles. It runs without sequence parallelism (a residual stream meshforge does not own cannot
    be annotated from outside).

    Raises ``ValueError`` naming the key for a module that cannot be split or a size not divisible
    by ``tp``, ``NotImplementedError`` for a split the plan cannot keep exact.
    """

    def __call__(
        self,
        model: nn.Module,
        *,
        tp: int,
        colwise: Sequence[tuple[str, nn.Module]],
        rowwise: Sequence[tuple[str, nn.Module]],
        loss_parallel: bool,
    ) -> dict[str, ParallelStyle]: ...


class CPModules(NamedTuple):
    """The module classes context parallelism switches (their ``cp`` attribute is the plan).

    Attributes:
        decoders: Inner models that build the per-forward CP mask (``cp.prepare``).
        attentions: Attention modules that call the plan instead of their own attention
            (``num_heads`` is split over the ulysses ranks).
        mixers: Other token mixers with their own head exchange (``num_k_heads`` split).
    """

    decoders: tuple[type[nn.Module], ...]
    attentions: tuple[type[nn.Module], ...]
    mixers: tuple[type[nn.Module], ...] = ()


class CPForward(Protocol):
    """What a generic transformers model's forward asks of its context-parallel plan.

    ``meshforge.parallel.context`` sets one as ``model.meshforge_cp``; the model calls it
    without knowing the parallel code.
    """

    keyword: str

    def prepare(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, object]:
        """This forward's global positions and the state handed to every attention call."""
        ...

    def check(self, model: nn.Module, state: object) -> None:
        """After the forward: refuse what the CP attention cannot have computed."""
        ...


class RecurrentState(Protocol):
    """One recurrent mixer's generation state between forwards (its ``state_cache`` hook).

    ``infer/kv_cache.py`` sets ``token_mask`` before each forward (``[B, S_new]`` bool, False on
    left padding; None when every token is real), keeps the rows a beam search continues with
    ``reorder`` and reports the memory with ``nbytes``. What the state holds is the mixer's own
    (Gated DeltaNet: conv window and delta-rule state; Mamba-3: SSM state, pending look-back,
    rotary angle).
    """

    token_mask: torch.Tensor | None

    def reorder(self, index: torch.Tensor) -> None: ...

    def nbytes(self) -> int: ...


class KVCacheModules(NamedTuple):
    """The module classes cached generation hooks into (``meshforge.infer.kv_cache``).

    The shared attention modules (``Attention`` and its subclasses, MLA, sink attention) need no
    naming: every family's attentions are among them. A decoder layer's token mixer is its first
    attribute of ``mixer_attributes`` that is a module.

    Attributes:
        decoders: Inner models with a ``decode_mask`` hook (the cache's mask of each forward).
        masks_by_layer_kind: The decoders' ``decode_mask`` returns ``{layer kind: mask}`` (full
            and sliding layers) instead of one mask. Only such decoders may have sliding layers:
            an attention mixer whose ``sliding_window`` attribute is an int keeps that many slots.
        recurrent: Token mixers with a ``state_cache`` hook instead of keys and values.
        new_state: A fresh state for one ``recurrent`` mixer (before the prompt).
        mixer_attributes: Decoder-layer attributes that may hold the token mixer, in order.
    """

    decoders: tuple[type[nn.Module], ...]
    masks_by_layer_kind: bool = False
    recurrent: tuple[type[nn.Module], ...] = ()
    new_state: Callable[[], RecurrentState] | None = None
    mixer_attributes: tuple[str, ...] = ("self_attn",)


class CPPlan(Protocol):
    """What model code calls on the context-parallel plan ``apply_cp`` hands it.

    ``meshforge.parallel.context.ContextParallel`` implements it; a family that switches its
    model to the plan itself (``FamilySpec.cp_apply``) sees only this.
    """

    method: str
    ulysses_size: int

    def prepare(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None
    ) -> tuple[object, torch.Tensor]:
        """This forward's CP mask object and the local tokens' global positions."""
        ...

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: object,
        *,
        scale: float,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attention of the local queries ``[B, H, S_local, Dv]`` over the whole rows."""
        ...


class ExpertsAdapter(Protocol):
    """Expert parallelism on experts modules that are no family container (``MoESpec.expert_type``).

    The transformers path's fused experts modules, chosen by ``parallelism.ep_modules``:
    ``parallel.expert.apply_ep`` matches the patterns, asks the adapter to check each module,
    shards its ``[num_experts, ...]`` weights and hands it the token exchange.
    """

    def check_dispatcher(self, token_dispatcher: str) -> None:
        """Refuse (``NotImplementedError``) a ``moe_token_dispatcher_type`` the EP forward cannot run."""
        ...

    def check(self, name: str, module: nn.Module) -> None:
        """Refuse (``NotImplementedError``, naming ``module`` and why) a module of another layout."""
        ...

    def use_exchange(self, module: nn.Module, exchange: TokenExchange) -> None:
        """Give a module whose weights EP sharded the forward that routes tokens through ``exchange``."""
        ...


@dataclass(frozen=True)
class MoESpec:
    """What expert parallelism and the router aux loss need of a mixture-of-experts family.

    Attributes:
        expert_type: Returns the experts container class (``[num_experts, ...]`` weights and
            the ``token_exchange`` seam).
        expert_count_key: The ``model.*`` key of the routed-expert count (for error messages).
        aux_reduce: Sets the process group the router statistics are summed over (CP ranks),
            or None when the family has no router aux loss.
    """

    expert_type: Callable[[], type[nn.Module]]
    expert_count_key: str
    aux_reduce: Callable[[nn.Module, DeviceMesh], None] | None = None


def _no_adapter(spec: FamilySpec, args: ModelArgs | None) -> HFStateDictAdapter:
    from meshforge.models.common.hf_adapter import HFAdapterBase

    return HFAdapterBase(spec, args)


@dataclass(frozen=True)
class FamilySpec:
    """A model family: everything the trainer, ``parallel/`` and ``checkpoint/`` need of it.

    Attributes:
        name: Family name, equal to its transformers ``model_type``.
        hf_architectures: transformers class names it stands for.
        model_ids: MindSpeed ``model_id`` values that select it.
        option_keys: ``model:`` passthrough keys the family declares.
        from_options: Validates ``model:`` options into the family's args (no torch).
        builder: ``(args, device) -> model``; imports the model module when called.
        adapter: ``(spec, args or None) -> HFStateDictAdapter``; default: the identity mapping.
        tp_plan: The tensor-parallel plan, or None when TP is not built for the family.
        stage_preparation: ``StageBatch -> run(layer, h)``: what a pipeline stage does before
            its layers (masks, RoPE), or None when PP is not built for the family.
        cp_modules: Returns the module classes CP switches, or None when CP is not built.
        cp_methods: The CP methods the family runs (None: all of them).
        cp_refusal: Why the other methods are refused (the error says it).
        moe: Expert parallelism and aux-loss hooks of a MoE family (None: dense).
        kv_cache: Returns the module classes meshforge's generation cache hooks into, or None
            when generation recomputes the whole sequence every step (no cache built).


        pattern_tp_plan: The TP plan from the ``tp_colwise`` / ``tp_rowwise`` module patterns,
            for a family without a plan of its own (``tp_plan`` None); runs without SP.
        fsdp_layer_units: FSDP wraps one unit per decoder layer; False: the units come from the
            ``parallelism.fsdp_modules`` patterns (module trees that vary), except under expert
            parallelism, whose experts need the per-layer units on the expert mesh.
        stage_check: Refuses, naming what is missing, a model the stage preparation cannot split
            (None: the usual ``model.layers`` ModuleList check only).
        cp_apply: Switches the model to a CP plan itself, for a family whose attention is no
            module class it owns (None: ``cp_modules`` names the classes CP switches).
        ep_adapter: Returns the adapter for experts modules that are no family container
            (None: only ``moe.expert_type`` containers are sharded).
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_ids: tuple[str, ...]
    option_keys: frozenset[str]
    from_options: Callable[[dict[str, object]], ModelArgs]
    builder: Callable[[ModelArgs, str | torch.device], nn.Module]
    adapter: Callable[[FamilySpec, ModelArgs | None], HFStateDictAdapter] = field(default=_no_adapter)
    tp_plan: TPPlan | None = None
    stage_preparation: Callable[[StageBatch], LayerRunner] | None = None
    cp_modules: Callable[[], CPModules] | None = None
    cp_methods: tuple[str, ...] | None = None
    cp_refusal: str = ""
    moe: MoESpec | None = None
    kv_cache: Callable[[], KVCacheModules] | None = None

    pattern_tp_plan: PatternTPPlan | None = None
    fsdp_layer_units: bool = True
    stage_check: Callable[[nn.Module], None] | None = None
    cp_apply: Callable[[nn.Module, CPPlan], None] | None = None
    ep_adapter: Callable[[], ExpertsAdapter] | None = None

    def cp_refused(self, method: str) -> tuple[str, str] | None:
        """``(key, reason)`` when context parallelism with ``method`` is refused, else None.

        The key is ``parallelism.context_parallel`` when the family runs no CP method (CP not
        built) and ``parallelism.context_parallel_method`` when it runs some but not ``method``;
        the reason is the spec's ``cp_refusal``. Light (no module is imported), so the config
        checks ask it before any model exists.
        """
        if self.cp_modules is None or self.cp_methods == ():
            why = self.cp_refusal or f"context parallelism is not built for {self.name}"
            return "parallelism.context_parallel", why
        if self.cp_methods is not None and method not in self.cp_methods:
            runs = ", ".join(self.cp_methods)
            return "parallelism.context_parallel_method", f"{method} (runs {runs}): {self.cp_refusal}"
        return None

    def parse_options(self, options: dict[str, object]) -> ModelArgs:
        """Validate ``options`` into the family's args dataclass (imports no torch)."""
        return self.from_options(options)

    def build(self, options: dict[str, object], *, device: str | torch.device = "meta") -> nn.Module:
        """Construct the model from passthrough options, on the meta device by default.

        Raises:
            ValueError: For an unknown or invalid option.
        """
        return self.builder(self.parse_options(options), device)

    def hf_adapter(self, args: ModelArgs | None = None) -> HFStateDictAdapter:
        """The family's HF state-dict adapter, bound to the model's ``args`` when given."""
        return self.adapter(self, args)


__all__ = [
    "CPForward",
    "CPModules",
    "CPPlan",
    "ExpertsAdapter",
    "FamilySpec",
    "GENERIC",
    "HFStateDictAdapter",
    "KVCacheModules",
    "MoESpec",
    "ModelArgs",
    "PatternTPPlan",
    "RecurrentState",
    "TPPlan",
]
