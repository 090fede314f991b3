"""The transformers path's tensor-parallel plan, from the ``tp_colwise`` / ``tp_rowwise`` patterns.

A transformers model's tree is not meshforge's to annotate, so the user's module patterns say
which layers split (``parallel.tensor.apply_tp`` matches them, naming the key on an error) and
this plan turns the matched modules into styles. transformers 5.24's Qwen3 and Llama attention
reshape the projections with ``view(*input_shape, -1, head_dim)`` and keep no head-count
attribute in forward (``num_key_value_groups`` is a ratio, unchanged when q and k/v heads are
split alike), so a column-split projection just yields the local heads.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.models.common.tp_plan import TP_KEY, check_divisible

# transformers' normalisation modules have family-specific class names (Qwen3RMSNorm, ...).
_NORM_MARKERS = ("LayerNorm", "RMSNorm", "GroupNorm")


def pattern_tp_plan(
    model: nn.Module,
    *,
    tp: int,
    colwise: Sequence[tuple[str, nn.Module]],
    rowwise: Sequence[tuple[str, nn.Module]],
    loss_parallel: bool,
) -> dict[str, ParallelStyle]:
    """The plan of the modules the ``tp_colwise`` / ``tp_rowwise`` patterns matched.

    Column-wise modules split their output features, row-wise ones their input features; both
    take and give replicated activations (no SP: a transformers layer's residual stream cannot be
    annotated from outside). An ``nn.Embedding`` matched row-wise splits the vocabulary. A matched
    ``lm_head`` stays vocab-sharded for the loss under ``loss_parallel``. Per-head norms next to a
    column-split projection (transformers' Qwen3 ``q_norm``/``k_norm``, weight of ``head_dim``
    elements) get replicated DTensor weights so their gradients are summed over the TP ranks.

    Args:
        model: The wrapped transformers model (or a pipeline stage of it).
        tp: The TP degree.
        colwise: ``(name, module)`` matched by ``parallelism.tp_colwise``.
        rowwise: ``(name, module)`` matched by ``parallelism.tp_rowwise``.
        loss_parallel: ``parallelism.enable_loss_parallel``.

    Raises:
        ValueError: a matched module is neither ``nn.Linear`` nor ``nn.Embedding``, a module is
            matched by both lists, or a split size or the head counts are not divisible by the
            TP degree.
        NotImplementedError: a norm over the whole (split) projection output, which would need
            the full features on every rank.
    """
    plan: dict[str, ParallelStyle] = {}
    both = {n for n, _ in colwise} & {n for n, _ in rowwise}
    if both:
        raise ValueError(
            f"parallelism.tp_colwise and parallelism.tp_rowwise both match {sorted(both)[0]}; "
            "a module is split one way only"
        )
    config = getattr(model, "config", None)
    heads = {
        key: int(getattr(config, key))
        for key in ("num_attention_heads", "num_key_value_heads")
        if isinstance(getattr(config, key, None), int)
    }
    check_divisible(heads, tp)
    for key_path, matches in (("parallelism.tp_colwise", colwise), ("parallelism.tp_rowwise", rowwise)):
        colwise_side = key_path.endswith("colwise")
        for name, module in matches:
            if isinstance(module, nn.Linear):
                size = module.out_features if colwise_side else module.in_features
                what = "out_features" if colwise_side else "in_features"
            elif isinstance(module, nn.Embedding):
                size = module.embedding_dim if colwise_side else module.num_embeddings
                what = "embedding_dim" if colwise_side else "num_embeddings"
            else:
                raise ValueError(
                    f"{key_path}: {name} is a {type(module).__name__}; only nn.Linear and nn.Embedding "
                    "modules can be split"
                )
            if size % tp:
                raise ValueError(f"{key_path}: {name}.{what} ({size}) is not divisible by {TP_KEY} ({tp})")
            if isinstance(module, nn.Embedding) and not colwise_side:
                plan[name] = RowwiseParallel(input_layouts=Replicate())
            elif colwise_side and name == "lm_head" and loss_parallel:
                plan[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            else:
                plan[name] = ColwiseParallel() if colwise_side else RowwiseParallel()
    plan.update(_head_norms(model, {n for n, m in colwise if isinstance(m, nn.Linear)}))
    return plan


def _head_norms(model: nn.Module, colwise_linears: set[str]) -> dict[str, ParallelStyle]:
    """Norm modules that sit beside a column-split projection and so see only the local heads."""
    plan: dict[str, ParallelStyle] = {}
    parents = {name.rpartition(".")[0] for name in colwise_linears}
    for parent in sorted(parents):
        owner = model.get_submodule(parent)
        head_dim = getattr(owner, "head_dim", None)
        for child_name, child in owner.named_children():
            if not any(marker in type(child).__name__ for marker in _NORM_MARKERS):
                continue
            weight = getattr(child, "weight", None)
            path = f"{parent}.{child_name}" if parent else child_name
            if weight is not None and head_dim is not None and weight.numel() == head_dim:
                plan[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
            else:
                raise NotImplementedError(
                    f"not supported yet: {TP_KEY} > 1 with {path} ({type(child).__name__}), a norm over "
                    "a column-split projection's whole output (only per-head norms of head_dim work)"
                )
    return plan


__all__ = ["pattern_tp_plan"]
