"""The transformers path's spec: any local ``AutoModelForCausalLM`` as one more ``FamilySpec``.

A folder whose config.json names no built-in family trains through transformers' own model
(``model.py`` wraps it in place). Its spec is built per folder (``generic_family``: the name is
the folder's ``model_type``, ``build`` reads its config.json), while its parallel pieces are the
same for every folder and are driven by module patterns and transformers' own functions:

* TP: ``pattern_tp_plan`` from ``parallelism.tp_colwise`` / ``tp_rowwise`` (``parallelize.py``), no SP;
* FSDP: units from ``parallelism.fsdp_modules`` (``fsdp_layer_units=False``);
* PP: ``stage_check`` and ``stage_preparation`` (``stage.py``);
* CP: ``cp_apply``, the plan as transformers' attention implementation (``cp.py``);
* EP: ``ep_adapter`` for transformers' fused experts modules (``experts.py``);
* HF checkpoints: transformers' weight-conversion mapping (``hf.py``).

``FAMILY`` holds those pieces without a folder: ``registry.spec_of_model`` gives it for a wrapped
model, so ``parallel/`` called without the run's spec finds the same pieces.

Light like every ``spec.py``: each piece imports its torch module when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshforge.models.spec import GENERIC, CPPlan, ExpertsAdapter, FamilySpec, HFStateDictAdapter, ModelArgs

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from meshforge.models.common.stage import LayerRunner, StageBatch


def load_auto_config(hf_dir: Path, *, trust_remote_code: bool) -> Any:
    """``AutoConfig`` of a local folder; transformers' errors re-raised naming the meshforge keys.

    Raises:
        ValueError: transformers cannot read the folder's config (unknown ``model_type``, or
            remote code that needs ``model.trust_remote_code: true``).
    """
    from transformers import AutoConfig

    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    try:
        return AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, **kwargs)
    except (ValueError, KeyError, OSError) as err:
        hint = (
            "; the folder ships its own modelling code: set model.trust_remote_code: true if you trust it"
            if not trust_remote_code and "trust_remote_code" in str(err)
            else ""
        )
        raise ValueError(
            f"model.model_name_or_path: transformers cannot build {hf_dir} through the generic "
            f"transformers path ({type(err).__name__}: {str(err).strip().splitlines()[0]}){hint}"
        ) from None


@dataclass(frozen=True)
class GenericFamily(FamilySpec):
    """A ``FamilySpec`` for a transformers model meshforge does not build itself.

    Attributes:
        hf_dir: The local folder with config.json.
        trust_remote_code: Passed to transformers only when True (``model.trust_remote_code``).
    """

    hf_dir: Path = field(default=Path("."))
    trust_remote_code: bool = False

    def parse_options(self, options: dict[str, object]) -> Any:
        """The folder's ``AutoConfig`` with ``options`` (passthrough ``model:`` keys) set on it."""
        config = load_auto_config(self.hf_dir, trust_remote_code=self.trust_remote_code)
        for key, value in options.items():
            setattr(config, key, value)
        return config

    def build(self, options: dict[str, object], *, device: str | torch.device = "meta") -> nn.Module:
        """Build the transformers model (SDPA attention) on ``device`` and wrap it in place."""
        from meshforge.models.generic.model import build_generic

        config = self.parse_options(options)
        return build_generic(config, device, hf_dir=self.hf_dir, trust_remote_code=self.trust_remote_code)


def _refuse_options(options: dict[str, object]) -> ModelArgs:
    raise TypeError("GenericFamily.parse_options reads the folder's config; call it on the family")


def _refuse_build(args: ModelArgs, device: str | torch.device) -> nn.Module:
    raise TypeError("GenericFamily.build builds from the folder; call it on the family")


def _adapter(spec: FamilySpec, args: ModelArgs | None) -> HFStateDictAdapter:
    from meshforge.models.generic.hf import GenericHFAdapter

    return GenericHFAdapter(spec, args)


def _tp_plan(
    model: nn.Module,
    *,
    tp: int,
    colwise: Sequence[tuple[str, nn.Module]],
    rowwise: Sequence[tuple[str, nn.Module]],
    loss_parallel: bool,
) -> dict[str, ParallelStyle]:
    from meshforge.models.generic.parallelize import pattern_tp_plan

    return pattern_tp_plan(model, tp=tp, colwise=colwise, rowwise=rowwise, loss_parallel=loss_parallel)


def _stage_check(model: nn.Module) -> None:
    from meshforge.models.generic.stage import check_generic_layout

    check_generic_layout(model)


def _stage_preparation(b: StageBatch) -> LayerRunner:
    from meshforge.models.generic.stage import stage_preparation

    return stage_preparation(b)


def _cp_apply(model: nn.Module, plan: CPPlan) -> None:
    from meshforge.models.generic.cp import apply_generic_cp

    apply_generic_cp(model, plan)


def _ep_adapter() -> ExpertsAdapter:
    from meshforge.models.generic.experts import FusedExpertsAdapter

    return FusedExpertsAdapter()


def _family(
    name: str, architectures: tuple[str, ...], hf_dir: Path, trust_remote_code: bool
) -> GenericFamily:
    return GenericFamily(
        name=name,
        hf_architectures=architectures,
        model_ids=(),
        option_keys=frozenset(),
        from_options=_refuse_options,
        builder=_refuse_build,
        adapter=_adapter,
        pattern_tp_plan=_tp_plan,
        fsdp_layer_units=False,
        stage_check=_stage_check,
        stage_preparation=_stage_preparation,
        cp_apply=_cp_apply,
        ep_adapter=_ep_adapter,
        hf_dir=hf_dir,
        trust_remote_code=trust_remote_code,
    )


def generic_family(hf_dir: Path, hf_config: dict[str, object], *, trust_remote_code: bool) -> GenericFamily:
    """The ``GenericFamily`` for a folder whose config.json (``hf_config``) names no built family."""
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if not isinstance(architectures, list | tuple):
        raise TypeError(f"config.json architectures: must be a list of names, got {architectures!r}")
    return _family(
        str(hf_config.get("model_type") or GENERIC),
        tuple(str(name) for name in architectures),
        Path(hf_dir),
        trust_remote_code,
    )


#: The transformers path's pieces without a folder (it builds nothing): the spec of a wrapped model.
FAMILY = _family(GENERIC, (), Path("."), False)


__all__ = ["FAMILY", "GenericFamily", "generic_family", "load_auto_config"]
