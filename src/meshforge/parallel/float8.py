"""Low-precision (float8 / MXFP8) training of linear layers through torchao's training APIs.

`model.quant_recipe_name` picks the recipe, named as torchao names them: the float8 recipes
`tensorwise`, `rowwise` and `rowwise_with_gw_hp` (`Float8LinearConfig.from_recipe_name`,
converter `quantize.linear.float8`: `Float8Linear`) and `mxfp8` (MindSpeed's name; torchao's
`MXFP8Linear` with RCEIL scales, converter `quantize.linear.mx`). The `nn.Linear` modules
converted are those inside a module matched by `quant_apply_modules` (MindSpeed default
`model.layers.{*}`: every decoder layer), except those matched by `quant_ignored_modules`
(`*lm_head`, `*gate`: the output head and MoE routers) and those whose sizes the recipe's
kernels cannot take (multiples of 16 for float8, of the 32-element block for MXFP8; skipped
and logged, as torchtitan does).

`parallelize_model` converts first, before the pipeline split, TP and FSDP (torchtitan's order):
the converted modules keep their parameters (plain tensors, the same names and shapes), so
initialisation, checkpoints and HF export do not change; only the matmuls quantise their
inputs on the fly.

Hardware: float8 matmuls need an sm89+ GPU, MXFP8 an sm100+ GPU; an older GPU or another
accelerator is refused naming `model.quant_recipe_name`. On the CPU every recipe runs through
torchao's emulation (quantise, dequantise, matmul in high precision): the same numerics, much
slower, logged once. TP (`tensor_parallel > 1`) is refused: the float8 TP styles are not wired.

FSDP2: `enable_fsdp_low_precision_all_gather` (default true, MindSpeed) all-gathers the weights
in float8 where torchao can (`enable_fsdp_float8_all_gather`, tensorwise only). With
`fsdp_low_precision_all_gather_mode: all` the float8 scales of every weight are computed
together once per step after the optimizer step (`precompute_float8_dynamic_scale_for_fsdp`,
one all-reduce for all weights); `on-demand` leaves each FSDP unit to compute its weights'
scales at its own all-gather. Where the recipe (rowwise, mxfp8), the run (no FSDP) or the
backend (gloo, which has no float8 collectives) cannot do it, the key is a logged no-op.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from meshforge.models.config import ModelConfig

__all__ = [
    "FLOAT8_CONVERTER",
    "FLOAT8_RECIPES",
    "MX_CONVERTER",
    "MX_RECIPES",
    "QuantPlan",
    "QuantSettings",
    "apply_quantization",
    "check_quant_device",
    "quant_settings",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MX_RECIPES = ("mxfp8",)
FLOAT8_CONVERTER = "quantize.linear.float8"
MX_CONVERTER = "quantize.linear.mx"
_CONVERTERS = {FLOAT8_CONVERTER: FLOAT8_RECIPES, MX_CONVERTER: MX_RECIPES}
# Smallest compute capability whose tensor cores run the recipe's matmuls.
_MIN_CAPABILITY = {"float8": (8, 9), "mx": (10, 0)}
_K = "model"


@dataclass(frozen=True)
class QuantSettings:
    """The `model.quant_*` keys, checked: the recipe, its converter and the module patterns."""

    recipe: str
    converter: str
    apply_modules: list[str]
    ignored_modules: list[str]
    fsdp_all_gather: bool
    all_gather_mode: str
    # Whether enable_fsdp_low_precision_all_gather was written (a default true that cannot act
    # is not worth a warning).
    all_gather_written: bool = False

    @property
    def kind(self) -> str:
        return "mx" if self.converter == MX_CONVERTER else "float8"


def quant_settings(model: ModelConfig) -> QuantSettings | None:
    """Check the `model.quant_*` keys (no torch needed); None when no recipe is set.

    `quant_converters` must hold the converter of the recipe's family (`quantize.linear.mx` for
    mxfp8, `quantize.linear.float8` for the float8 recipes); left at its default it follows the
    recipe.

    Raises:
        ValueError: naming the key, for an unknown converter, one that does not fit the recipe,
            or patterns that do not compile.
    """
    from meshforge.utils.patterns import compile_pattern

    recipe = model.quant_recipe_name
    if recipe is None:
        return None
    wanted = MX_CONVERTER if recipe in MX_RECIPES else FLOAT8_CONVERTER
    converters = list(model.quant_converters)
    if "quant_converters" not in model.model_fields_set:
        converters = [wanted]
    for i, name in enumerate(converters):
        if name.startswith(("quantize.grouped_mm.", "quantize.moe.")):
            raise ValueError(
                f"not supported yet: {_K}.quant_converters[{i}]={name} (grouped expert matmuls in "
                f"low precision); built: {', '.join(_CONVERTERS)}"
            )
        if name not in _CONVERTERS:
            raise ValueError(
                f"{_K}.quant_converters[{i}]: unknown converter {name!r}; valid: {', '.join(_CONVERTERS)}"
            )
    if converters != [wanted]:
        raise ValueError(
            f"{_K}.quant_converters: {converters} does not fit {_K}.quant_recipe_name={recipe}; "
            f"it takes [{wanted!r}]"
        )
    for key in ("quant_apply_modules", "quant_ignored_modules"):
        for i, pattern in enumerate(getattr(model, key)):
            try:
                compile_pattern(pattern)
            except ValueError as err:
                raise ValueError(f"{_K}.{key}[{i}]: {err}") from None
    return QuantSettings(
        recipe=recipe,
        converter=wanted,
        apply_modules=list(model.quant_apply_modules),
        ignored_modules=list(model.quant_ignored_modules),
        fsdp_all_gather=model.enable_fsdp_low_precision_all_gather,
        all_gather_mode=model.fsdp_low_precision_all_gather_mode,
        all_gather_written="enable_fsdp_low_precision_all_gather" in model.model_fields_set,
    )


def check_quant_device(settings: QuantSettings, device: torch.device) -> bool:
    """Whether the recipe runs emulated on `device` (True on the CPU); raise where it cannot run.

    Raises:
        ValueError: `model.quant_recipe_name=...` needs an sm89+ (float8) or sm100+ (mxfp8)
            GPU, or the device type has no torchao kernels.
    """
    import torch

    if device.type == "cpu":
        return True
    need = _MIN_CAPABILITY[settings.kind]
    gpu = "sm89+ (Ada, Hopper or newer)" if settings.kind == "float8" else "sm100+ (Blackwell)"
    if device.type != "cuda":
        raise ValueError(
            f"{_K}.quant_recipe_name={settings.recipe}: needs a CUDA GPU of compute capability "
            f"{gpu} or the CPU (emulated); {device.type} has no torchao low-precision kernels"
        )
    have = torch.cuda.get_device_capability(device)
    if tuple(have) < need:
        raise ValueError(
            f"{_K}.quant_recipe_name={settings.recipe}: this GPU ({torch.cuda.get_device_name(device)}, "
            f"sm{have[0]}{have[1]}) cannot run it; it needs {gpu}"
        )
    return False


@dataclass
class QuantPlan:
    """What `apply_quantization` did, and the per-step hook it needs (None: nothing to do)."""

    settings: QuantSettings
    converted: list[str]
    skipped: list[str]
    emulated: bool
    fsdp_all_gather: bool
    notes: list[str] = field(default_factory=list)
    after_optimizer_step: Callable[[nn.Module], None] | None = None

    def summary(self) -> str:
        mode = ", emulated (CPU)" if self.emulated else ""
        gather = f", float8 FSDP all-gather ({self.settings.all_gather_mode})" if self.fsdp_all_gather else ""
        skipped = (
            f"; {len(self.skipped)} skipped (sizes): {', '.join(self.skipped[:4])}" if self.skipped else ""
        )
        return (
            f"model.quant_recipe_name={self.settings.recipe}: {len(self.converted)} linear layers through "
            f"{self.settings.converter}{mode}{gather}{skipped}"
        )


def _quiet_import() -> None:
    """Import torchao once without its messages about the CUDA extensions a CPU build lacks."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        import torchao  # noqa: F401


def _selected(
    model: nn.Module, settings: QuantSettings, *, allow_unmatched: bool
) -> list[tuple[str, nn.Linear]]:
    """The `nn.Linear` modules inside an apply pattern's match and outside every ignored one."""
    import torch.nn as nn

    from meshforge.utils.patterns import compile_pattern, match_modules

    roots = match_modules(
        model, settings.apply_modules, key_path=f"{_K}.quant_apply_modules", allow_unmatched=allow_unmatched
    )
    ignored = [compile_pattern(p) for p in settings.ignored_modules]
    root_names = [name for name, _ in roots]
    out: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        inside = any(name == r or name.startswith(f"{r}.") or r == "" for r in root_names)
        if inside and not any(p.matches(name) for p in ignored):
            out.append((name, module))
    return out


def apply_quantization(
    model: nn.Module,
    settings: QuantSettings,
    *,
    device: torch.device,
    fsdp: bool,
    fsdp_backend: str | None,
    partial: bool = False,
) -> QuantPlan:
    """Swap the selected linear layers of `model` (meta device is fine) for torchao's training ones.

    Args:
        settings: from `quant_settings`.
        device: where the run computes (CPU: emulated).
        fsdp: whether FSDP2 will shard the model (float8 all-gather only then).
        fsdp_backend: the process-group backend of the FSDP mesh (`gloo` has no float8 collectives).
        partial: the model is one pipeline stage's part: a pattern may match nothing here.

    Raises:
        ValueError: naming `model.quant_apply_modules` when a pattern matches no module or no
            linear layer is selected; the device checks of `check_quant_device`.
    """
    emulated = check_quant_device(settings, device)
    chosen = _selected(model, settings, allow_unmatched=partial)
    block = 32 if settings.kind == "mx" else 16
    fits = [(n, m) for n, m in chosen if m.in_features % block == 0 and m.out_features % block == 0]
    skipped = [n for n, m in chosen if (n, m) not in fits]
    if not fits and not partial:
        raise ValueError(
            f"{_K}.quant_apply_modules: {settings.apply_modules} minus {_K}.quant_ignored_modules "
            f"{settings.ignored_modules} selects no nn.Linear whose sizes are multiples of {block} "
            f"(selected {len(chosen)}, skipped for their sizes: {skipped[:4]})"
        )
    _quiet_import()
    notes: list[str] = []
    gather = False
    if settings.fsdp_all_gather:
        # Notes for a written key only; the default (true) is applied where it can act.
        if settings.recipe != "tensorwise":
            notes.append(
                f"{_K}.enable_fsdp_low_precision_all_gather: no effect with {settings.recipe} (torchao "
                "all-gathers float8 weights for the tensorwise recipe only); weights gather in "
                "the compute dtype"
            )
        elif not fsdp:
            notes.append(f"{_K}.enable_fsdp_low_precision_all_gather: no effect without FSDP")
        elif fsdp_backend == "gloo":
            notes.append(
                f"{_K}.enable_fsdp_low_precision_all_gather: no effect on gloo (no float8 "
                "collectives); weights gather in the compute dtype"
            )
        else:
            gather = True
    if not settings.all_gather_written:
        notes = []
    names = {n for n, _ in fits}
    if settings.kind == "mx":
        _swap_mx(model, names, emulated=emulated)
    else:
        _swap_float8(model, names, settings.recipe, emulated=emulated, fsdp_all_gather=gather)
    hook = None
    if gather and settings.all_gather_mode == "all":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        hook = precompute_float8_dynamic_scale_for_fsdp
    return QuantPlan(
        settings=settings,
        converted=sorted(names),
        skipped=skipped,
        emulated=emulated,
        fsdp_all_gather=gather,
        notes=notes,
        after_optimizer_step=hook,
    )


def _swap_float8(
    model: nn.Module, names: set[str], recipe: str, *, emulated: bool, fsdp_all_gather: bool
) -> None:
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulated,
        enable_fsdp_float8_all_gather=fsdp_all_gather,
    )
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in names, config=config)


@functools.cache
def _mx_linear_class() -> Callable[..., nn.Linear]:
    import torch
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm

    class AutocastMXFP8Linear(MXFP8Linear):
        """torchao's `MXFP8Linear`, casting like `nn.Linear` under autocast.

        Autocast does not reach inside torchao's MX tensors: a bf16 input would meet an fp32
        weight in the emulated matmul. Under autocast both are cast to the autocast dtype first,
        as autocast does for `nn.Linear`'s matmul.
        """

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
            kind = input.device.type
            if not torch.is_autocast_enabled(kind):
                return super().forward(input)
            dtype = torch.get_autocast_dtype(kind)
            with torch.autocast(kind, enabled=False):
                out = _to_mxfp8_then_scaled_mm(
                    input.to(dtype),
                    self.weight.to(dtype),
                    kernel_preference=self.kernel_preference,
                    scale_calculation_mode=self.scale_calculation_mode,
                    wgrad_with_hp=self.wgrad_with_hp,
                )
                if self.bias is not None:
                    out = out + self.bias.to(out.dtype)
            return out

    return AutocastMXFP8Linear


def _swap_mx(model: nn.Module, names: set[str], *, emulated: bool) -> None:
    import torch.nn as nn
    from torchao.quantization.quantize_.common import KernelPreference

    preference = KernelPreference.EMULATED if emulated else KernelPreference.AUTO
    cls = _mx_linear_class()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = parent.get_submodule(child)
        assert isinstance(old, nn.Linear)
        new = cls(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            device="meta",
            dtype=old.weight.dtype,
            kernel_preference=preference,
        )
        # The same Parameter objects: names, init and checkpoints are those of nn.Linear.
        new.weight = old.weight
        new.bias = old.bias
        setattr(parent, child, new)
