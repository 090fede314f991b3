"""What one token costs in each decoder layer: the step-time model's view of a model.

The model is built on the meta device (no memory), as the memory planner builds it, and read
by module structure rather than by family: matmul weights are the 2-D weights of linear layers
(routers included), routed experts are the 3-D fused expert tensors, a module with ``top_k`` and
``num_experts`` is a router (the active fraction of its layer's experts is ``top_k /
num_experts``), and a module with ``num_heads`` and a head dimension is an attention core
whose score and value products grow with the context. Linear-attention and state-space layers
(Qwen3-Next's gated delta rule, Mamba-3) have no such module: their cost is their projections.

Recompute is read off the same `apply_activation_memory` the trainer and the planner run, so the
extra forward priced for it covers exactly the layers and modules the run recomputes, less the
matmuls and attention whose outputs `recompute.exclude_op` keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from meshforge.config.root import TrainConfig


@dataclass(frozen=True)
class AttentionCore:
    """One attention module's shape: the products that scale with the context."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    window: int | None

    def forward_flops(self, context: float) -> float:
        """Forward FLOPs of one query token attending `context` keys (QK^T and PV)."""
        return 2.0 * self.heads * (self.qk_dim + self.v_dim) * context

    def kv_elements(self) -> int:
        """Key and value elements one token adds (what context parallelism exchanges)."""
        return self.kv_heads * (self.qk_dim + self.v_dim)


@dataclass
class LayerWork:
    """One decoder layer: parameters by kind and what the run recomputes of it.

    Attributes:
        dense: Matmul weights of the layer outside the routed experts (attention projections,
            dense or shared MLPs, the router).
        experts: Routed-expert weights of the layer (every expert).
        active: Fraction of the routed experts a token runs through (top_k / num_experts).
        top_k: Experts per token (0 for a dense layer).
        attention: The attention cores of the layer.
        recompute: Fraction of the layer's forward recomputed in backward.
        recompute_attention: Whether the attention cores are inside the recomputed part.
        linear_io: Input plus output features summed over the layer's linear modules: what the
            low-rank adapters on them read and write per token.
    """

    dense: int = 0
    experts: int = 0
    active: float = 0.0
    top_k: int = 0
    attention: list[AttentionCore] = field(default_factory=list)
    recompute: float = 0.0
    recompute_attention: bool = False
    linear_io: int = 0  # inputs plus outputs of the layer's linear modules (a LoRA adapter's traffic)

    def matmul_forward_flops(self) -> float:
        """Forward matmul FLOPs of one token (2 per multiply-add of each weight it meets)."""
        return 2.0 * (self.dense + self.experts * self.active)


@dataclass
class ModelWork:
    """A model's per-token work, layer by layer, plus the embedding and the output head."""

    hidden: int
    vocab: int
    layers: list[LayerWork]
    head: int  # matmul weights of the output head (a tied head still multiplies)
    num_mtp: int = 0  # trailing layers that are multi-token-prediction blocks

    def model_flops_per_token(self, seq: int) -> float:
        """Training FLOPs of one token by the usual convention: 6 x active matmul weights, plus the
        attention products over the full sequence (no causal halving), as meshforge's MFU counts."""
        total = 6.0 * self.head
        for layer in self.layers:
            total += 3.0 * layer.matmul_forward_flops()
            total += sum(3.0 * core.forward_flops(min(seq, core.window or seq)) for core in layer.attention)
        return total


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _attention_core(module: nn.Module) -> AttentionCore | None:
    heads = _int(getattr(module, "num_heads", None))
    qk = _int(getattr(module, "qk_head_dim", None)) or _int(getattr(module, "head_dim", None))
    if heads is None or qk is None:
        return None
    v = _int(getattr(module, "v_head_dim", None)) or qk
    kv_heads = _int(getattr(module, "num_kv_heads", None)) or heads
    return AttentionCore(heads, kv_heads, qk, v, _int(getattr(module, "sliding_window", None)))


def layer_work(layer: nn.Module) -> LayerWork:
    """Parameters by kind and the attention cores of one decoder layer."""
    from torch import nn

    work = LayerWork()
    routers = [
        (top_k, experts)
        for m in layer.modules()
        if (top_k := _int(getattr(m, "top_k", None))) and (experts := _int(getattr(m, "num_experts", None)))
    ]
    for _name, param in layer.named_parameters():
        if param.dim() == 3:
            work.experts += param.numel()
        elif param.dim() == 2:
            work.dense += param.numel()
    if routers and work.experts:
        work.top_k, experts = routers[0]
        work.active = work.top_k / experts
    work.linear_io = sum(m.in_features + m.out_features for m in layer.modules() if isinstance(m, nn.Linear))
    work.attention = [core for m in layer.modules() if (core := _attention_core(m)) is not None]
    return work


def _recomputed_share(layer: nn.Module, paths: list[str]) -> tuple[float, bool]:
    """Fraction of a layer's weights under `paths` ("" = the whole layer), and whether they hold
    the attention cores."""
    if "" in paths:
        return 1.0, True
    total = sum(p.numel() for p in layer.parameters() if p.dim() >= 2) or 1
    covered = 0
    attention = False
    for path in paths:
        module = layer.get_submodule(path)
        covered += sum(p.numel() for p in module.parameters() if p.dim() >= 2)
        attention = attention or any(_attention_core(m) is not None for m in module.modules())
    return min(1.0, covered / total), attention


@dataclass(frozen=True)
class _KeptCalls:
    """What `recompute.exclude_op` keeps: one matmul in every `matmul_every` (0: none), attention."""

    matmul_every: int = 0
    attention: bool = False


def _kept_calls(entries: list[str] | None) -> _KeptCalls:
    import torch

    from meshforge.memory.recompute import resolve_kept

    aten = torch.ops.aten
    matmuls = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    every = 0
    attention = False
    for op, n in resolve_kept(entries):
        packet = getattr(op, "overloadpacket", op)
        if packet in matmuls:
            every = n if not every else min(every, n)
        elif "scaled_dot_product" in str(packet):
            attention = True
    return _KeptCalls(every, attention)


def _kept_matmul_share(layer: nn.Module, paths: list[str], every: int) -> float:
    """Share of the layer's matmul weights whose outputs a `matmul/every` policy keeps in each
    recomputed region: the linears in module order (their call order in a decoder layer), the
    first of every `every` kept."""
    from torch import nn

    total = sum(p.numel() for p in layer.parameters() if p.dim() >= 2) or 1
    kept = 0
    for path in paths:
        region = layer if path == "" else layer.get_submodule(path)
        linears = [m for m in region.modules() if isinstance(m, nn.Linear)]
        kept += sum(m.weight.numel() for i, m in enumerate(linears) if i % every == 0)
    return kept / total


def model_work(cfg: TrainConfig, *, log: Callable[[str], None] | None = None) -> ModelWork:
    """Build the configured model on the meta device and read its per-token work."""
    import torch

    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.memory.apply import ActivationSettings, apply_activation_memory
    from meshforge.memory.config import RecomputeCommConfig, SwapConfig
    from meshforge.memory.names import decoder_layers

    source = resolve_model_source(cfg.model, log=log)
    with torch.device("meta"):
        model = source.family.build(source.options)
    embedding = model.get_submodule("model.embed_tokens")
    weight = getattr(embedding, "weight", None)
    assert weight is not None, "a causal LM has an input embedding"
    vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
    layers = dict(decoder_layers(model))
    works = [layer_work(layers[index]) for index in sorted(layers)]
    if cfg.recompute.mode != "None":
        applied = apply_activation_memory(
            model,
            ActivationSettings(cfg.recompute, RecomputeCommConfig(), SwapConfig()),
            num_layers=len(layers),
            tp_mesh=None,
        )
        kept = _kept_calls(cfg.recompute.exclude_op)
        for index, paths in applied.recomputed.items():
            if index < len(works):
                share, attention = _recomputed_share(layers[index], paths)
                if kept.matmul_every:
                    share -= _kept_matmul_share(layers[index], paths, kept.matmul_every)
                works[index].recompute = max(0.0, share)
                works[index].recompute_attention = attention and not kept.attention
    # Multi-token-prediction blocks are the trailing layers; they cost only when the run trains them.
    num_mtp = _int(getattr(model, "num_mtp_layers", None)) or 0
    if num_mtp and cfg.training.mtp_loss_scaling_factor <= 0:
        works, num_mtp = works[:-num_mtp], 0
    return ModelWork(hidden=hidden, vocab=vocab, layers=works, head=vocab * hidden, num_mtp=num_mtp)
