"""``apply_cp``: switch a model's attention (and other token mixers) to its context-parallel plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshforge.parallel.context.layout import resolve_method
from meshforge.parallel.context.plan import ContextParallel

if TYPE_CHECKING:
    from meshforge.models.spec import FamilySpec


def _ulysses_size(cp_mesh: DeviceMesh, method: str, ulysses_degree: int | None) -> int:
    """The ulysses group size of ``method`` (1 for the ring methods), validated against the mesh."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_cp: expects the 1-D cp mesh, got {cp_mesh.ndim} dims")
    size = cp_mesh.size()
    if method == "ulysses":
        if ulysses_degree not in (None, size):
            raise ValueError(
                f"parallelism.ulysses_degree_in_cp: ulysses CP requires it to equal context_parallel ({size}), "
                f"got {ulysses_degree}"
            )
        return size
    if method == "hybrid":
        if ulysses_degree is None or not 1 < ulysses_degree < size or size % ulysses_degree:
            raise ValueError(
                "parallelism.ulysses_degree_in_cp: hybrid CP requires 1 < ulysses_degree_in_cp < "
                f"context_parallel ({size}) dividing it, got {ulysses_degree}"
            )
        return ulysses_degree
    return 1


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh,
    *,
    method: str,
    ulysses_degree: int | None = None,
    family: FamilySpec | None = None,
) -> None:
    """Switch every attention module of ``model`` to the context-parallel algorithm, in place.

    Works on the meta device (only attributes change). The batch must then be cut with
    :func:`shard_batch_for_cp` using the same ``method``.

    Args:
        model: A causal LM whose family spec gives CP modules (``FamilySpec.cp_modules``,
            limited to ``cp_methods``) or switches the model itself (``FamilySpec.cp_apply``:
            the transformers path's attention implementation).
        cp_mesh: The 1-D context-parallel mesh (every CP rank calls this: hybrid creates
            sub-groups).
        method: ``colossal`` (alias ``ring``), ``ulysses``, ``hybrid`` or ``kvallgather``.
        ulysses_degree: ``parallelism.ulysses_degree_in_cp``: for ulysses None or the CP
            degree; for hybrid ``1 < u < cp`` dividing cp.
        family: The model's spec (None: the registry's ``spec_of_model``).

    Raises:
        NotImplementedError: For a model without CP modules, or a method its family refuses
            (the spec's ``cp_refusal`` says why).
        ValueError: For a bad method, ulysses degree or head count.
    """
    method = resolve_method(method)
    from meshforge.models.registry import built_families, spec_of_model

    spec = family if family is not None else spec_of_model(model)
    name = spec.name if spec is not None else type(model).__name__
    if spec is not None and spec.cp_methods is not None and method not in spec.cp_methods:
        raise NotImplementedError(
            f"not supported yet: parallelism.context_parallel > 1 for {name}: context_parallel_method "
            f"{method}: {spec.cp_refusal}"
        )
    if spec is not None and spec.cp_apply is not None:
        # A family whose attention is no module class of its own switches the model itself
        # (the transformers path: the plan as the model's attention implementation).
        spec.cp_apply(model, ContextParallel(cp_mesh, method, _ulysses_size(cp_mesh, method, ulysses_degree)))
        return
    targets = spec.cp_modules() if spec is not None and spec.cp_modules is not None else None
    decoders = [m for m in model.modules() if targets and isinstance(m, targets.decoders)]
    attentions = [m for m in model.modules() if targets and isinstance(m, targets.attentions)]
    # Token mixers with their own head exchange (qwen3_next's Gated DeltaNet, ulysses only).
    mixers = [m for m in model.modules() if targets and targets.mixers and isinstance(m, targets.mixers)]
    if not decoders or not (attentions or mixers):
        raise NotImplementedError(
            f"not supported yet: parallelism.context_parallel > 1 for {name} (CP runs on the built-in "
            f"families {', '.join(built_families())} and the generic transformers path)"
        )
    u = _ulysses_size(cp_mesh, method, ulysses_degree)
    for attn in attentions:
        # Every CP attention class (CPModules.attentions) keeps its head count in an int num_heads.
        heads = cast(int, attn.num_heads)
        if heads % u:
            raise ValueError(
                f"parallelism.context_parallel: {method} splits the {heads} attention heads over "
                f"{u} ranks; num_attention_heads must divide by {u}"
            )
    for mixer in mixers:
        # Whole key-head groups per rank (value heads are a multiple of key heads, so they follow).
        # CPModules.mixers keep their key-head count in an int num_k_heads.
        k_heads = cast(int, mixer.num_k_heads)
        if k_heads % u:
            raise ValueError(
                f"parallelism.context_parallel: ulysses splits the {k_heads} Gated DeltaNet key heads "
                f"(per tensor-parallel rank) over {u} ranks; model.linear_num_key_heads must divide by {u} "
                "(model.linear_num_value_heads, a multiple of it, then does too)"
            )
    plan = ContextParallel(cp_mesh, method, u)
    for module in (*decoders, *attentions, *mixers):
        # torch types nn.Module.__setattr__'s value Tensor | Module; other values become plain attributes.
        module.cp = plan  # type: ignore[assignment]


__all__ = ["apply_cp"]
