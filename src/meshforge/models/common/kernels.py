"""Kernel switches: from the ``kernels:`` config section to flags on a built model.

The trainer turns the section into a :class:`KernelOptions` once, for the device the run
uses (:func:`resolve_kernel_options`): a switch set to ``true`` that cannot run there is a
no-op on that device, warned at start (``warning: kernels.<key>: true has no effect here:
<why>; ...``), never a silent fallback, so one launch line (MindSpeed's sets these switches
true) runs on an accelerator and on a CPU test machine alike; ``auto`` turns it on only where
it runs, without the warning. The options then reach the
model through one small, opt-in interface:

* a family that supports switches defines ``configure_kernels(self, options) -> None`` on its
  top-level module (the built-in families call :func:`apply_kernel_options`, which sets flags
  on the shared blocks of ``models/common``: :class:`RMSNorm`, :class:`Attention`,
  ``GroupedExperts`` and ``TopKRouter``); it raises ``ValueError`` naming the key for a switch
  it cannot honour (``fix_router`` on a dense model, for instance);
* a family without ``configure_kernels`` trains with every switch off; asking for one is an
  error (:func:`configure_model_kernels`);
* ``chunk_loss_size`` needs ``forward(..., return_hidden=True)`` returning the final
  (normed) hidden states and an ``lm_head`` linear layer without bias
  (:func:`supports_hidden_output`); ``compile`` needs ``model.layers`` (see :func:`apply_compile`).

What each switch does, and which path is the default:

* ``use_flash_attn``: SDPA restricted to the flash backend (CUDA, fp16/bf16 only). Default
  off: SDPA picks its own backend. ``true`` on the CPU is a warned no-op.
* ``use_fused_rmsnorm``: ``torch.nn.functional.rms_norm`` (also the default when the key is
  not written); ``false`` written out selects the reference formulation as transformers
  writes it (``x.float() * rsqrt(mean(x^2) + eps)``, scaled in the input dtype).
* ``use_fused_rotary_pos_emb``: torch ships no fused rotary kernel, so ``true`` is a warned
  no-op on every device and ``auto`` keeps the plain ``rotate_half`` formulation.
* ``moe_grouped_gemm``: MoE experts as one ``F.grouped_mm`` per projection (same numbers).
* ``fix_router``: fixed, balanced routing for performance tuning: token ``i`` (flattened over
  batch and sequence) goes to experts ``(i * k + j) mod E`` for ``j < k``; the routing weights
  are the router probabilities of those experts (renormalised when ``norm_topk_prob``), so
  the router still gets a gradient. MoE families only.
* ``compile``: ``torch.compile`` of every decoder layer, before FSDP wraps it.
* ``chunk_loss_size``: cross-entropy over sequence chunks (``meshforge.loss``).

Light module: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from meshforge.models.config import KernelsConfig

_AUTO_HINT = "set it to auto to use it only where available, without this warning"


@dataclass(frozen=True)
class KernelOptions:
    """Resolved kernel switches for one run (plain booleans, no ``auto`` left).

    Attributes:
        flash_attn: Restrict SDPA to the flash backend.
        flash_attn_strict: ``use_flash_attn: true`` (not auto): a forward that flash attention
            cannot run (a packed-document mask) is an error instead of plain SDPA.
        fused_rmsnorm: ``F.rms_norm`` (True), the reference formulation (False), or None
            for the family's default (``F.rms_norm`` in the built-in families).
        fused_rope: A fused rotary kernel (never True today; see the module docstring).
        grouped_mm: MoE experts through ``F.grouped_mm``.
        fix_router: Fixed balanced expert assignment (MoE only).
        compile: ``torch.compile`` each decoder layer.
        chunk_loss_size: Tokens per cross-entropy chunk, or None for the full-logits loss.
        gdn_chunk_size: Chunk length of the chunked Gated DeltaNet (qwen3_next), or None when
            the config does not set it (the layers' default, 64).
    """

    flash_attn: bool = False
    flash_attn_strict: bool = False
    fused_rmsnorm: bool | None = None
    fused_rope: bool = False
    grouped_mm: bool = False
    fix_router: bool = False
    compile: bool = False
    chunk_loss_size: int | None = None
    gdn_chunk_size: int | None = None

    def model_switches(self) -> dict[str, bool]:
        """Config key -> on, for the switches a model must honour in ``configure_kernels``."""
        return {
            "use_flash_attn": self.flash_attn,
            "use_fused_rmsnorm": self.fused_rmsnorm is not None,
            "use_fused_rotary_pos_emb": self.fused_rope,
            "moe_grouped_gemm": self.grouped_mm,
            "fix_router": self.fix_router,
        }


def _flash_reason(device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Why flash SDPA cannot run here, or None when it can."""
    import torch

    if device.type != "cuda":
        return f"flash attention needs a CUDA device (this run uses {device.type})"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention kernel"
    if compute_dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention runs in float16/bfloat16 only (model.compute_dtype is {compute_dtype})"
    return None


def resolve_kernel_options(
    kernels: KernelsConfig,
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    warn: Callable[[str], None] = print,
) -> KernelOptions:
    """Turn the ``kernels`` config section into :class:`KernelOptions` for ``device``.

    Args:
        kernels: The validated ``KernelsConfig`` (``true``/``false``/``"auto"`` values).
        device: The device this process trains on.
        compute_dtype: The model's compute dtype (flash attention needs fp16/bf16).
        warn: Receives one ``warning: kernels.<key>: ...`` line for each switch set to true
            that cannot run on ``device`` (it is then off).

    Returns:
        The options with every ``auto`` decided.

    Raises:
        ValueError: ``kernels.moe_grouped_gemm`` on a torch without ``grouped_mm``.
    """
    import torch.nn.functional as F

    flash = kernels.use_flash_attn
    flash_on = False
    if flash is not False:
        reason = _flash_reason(device, compute_dtype)
        if reason is not None and flash is True:
            warn(
                f"warning: kernels.use_flash_attn: true has no effect here: {reason}; SDPA picks its backend ({_AUTO_HINT})"
            )
        flash_on = reason is None

    rope = kernels.use_fused_rotary_pos_emb
    if rope is True:
        warn(
            "warning: kernels.use_fused_rotary_pos_emb: true has no effect here: torch has no fused "
            f"rotary-embedding kernel on {device.type}; the plain formulation runs ({_AUTO_HINT})"
        )

    # Not written: the family's default (F.rms_norm). Written false: the reference formulation.
    norm = kernels.use_fused_rmsnorm
    fused_norm = None if "use_fused_rmsnorm" not in kernels.model_fields_set else norm is not False

    grouped = kernels.moe_grouped_gemm
    if grouped and not hasattr(F, "grouped_mm"):
        raise ValueError("kernels.moe_grouped_gemm: this torch has no torch.nn.functional.grouped_mm")

    return KernelOptions(
        flash_attn=flash_on,
        flash_attn_strict=flash is True and flash_on,
        fused_rmsnorm=fused_norm,
        fused_rope=False,
        grouped_mm=grouped,
        fix_router=kernels.fix_router,
        compile=kernels.compile,
        chunk_loss_size=kernels.chunk_loss_size,
        gdn_chunk_size=kernels.gdn_chunk_size if "gdn_chunk_size" in kernels.model_fields_set else None,
    )


def apply_kernel_options(model: nn.Module, options: KernelOptions, *, family: str) -> None:
    """Set the switches on the shared ``models/common`` blocks inside ``model``.

    What the built-in families' ``configure_kernels`` calls. Blocks of other types are left
    alone, so a family mixing its own modules with common ones gets the switches only where
    the common blocks are.

    Args:
        model: The model (any device, including meta).
        options: Resolved options.
        family: Family name, for error messages.

    Raises:
        ValueError: ``kernels.fix_router`` or ``kernels.moe_grouped_gemm`` on a model
            without MoE blocks.
    """
    from meshforge.models.common.attention import Attention
    from meshforge.models.common.moe import GroupedExperts, TopKRouter
    from meshforge.models.common.norms import RMSNorm

    modules = list(model.modules())
    experts = [m for m in modules if isinstance(m, GroupedExperts)]
    routers = [m for m in modules if isinstance(m, TopKRouter)]
    if options.fix_router and not routers:
        raise ValueError(f"kernels.fix_router: {family} has no MoE router (a dense model); unset it")
    if options.grouped_mm and not experts:
        raise ValueError(f"kernels.moe_grouped_gemm: {family} has no MoE experts (a dense model); unset it")
    if options.gdn_chunk_size is not None and not any(type(m).__name__ == "GatedDeltaNet" for m in modules):
        raise ValueError(
            f"kernels.gdn_chunk_size: {family} has no Gated DeltaNet layers (only qwen3_next has); unset it"
        )
    for module in modules:
        if isinstance(module, RMSNorm) and options.fused_rmsnorm is not None:
            module.fused = options.fused_rmsnorm
        elif isinstance(module, Attention):
            module.flash = options.flash_attn
            module.flash_strict = options.flash_attn_strict
    for module in experts:
        module.use_grouped_mm = options.grouped_mm
    for module in routers:
        module.fixed = options.fix_router


def configure_model_kernels(model: nn.Module, options: KernelOptions, *, family: str) -> None:
    """Hand ``options`` to ``model.configure_kernels``, or refuse switches it cannot take.

    Raises:
        ValueError: A switch is on and the family has no ``configure_kernels``, or
            ``chunk_loss_size`` is set and the model cannot return hidden states.
    """
    configure = getattr(model, "configure_kernels", None)
    if callable(configure):
        configure(options)
    else:
        for key, on in options.model_switches().items():
            if on:
                raise ValueError(f"kernels.{key}: not supported by the {family} model family; unset it")
    if options.chunk_loss_size is not None and not supports_hidden_output(model):
        raise ValueError(
            f"kernels.chunk_loss_size: the {family} model does not expose its final hidden states "
            "(forward(..., return_hidden=True) and a bias-free lm_head); unset it"
        )


def supports_hidden_output(model: nn.Module) -> bool:
    """Whether ``model`` can feed the chunked loss: ``return_hidden`` and a bias-free ``lm_head``."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "bias", None) is not None:
        return False
    return "return_hidden" in inspect.signature(model.forward).parameters


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (``model.model.layers``), before FSDP.

    ``nn.Module.compile`` keeps the module and its parameter names (no ``_orig_mod``
    prefix), so checkpoints and module patterns are unchanged. Per-layer compilation (the
    torchtitan order: compile, then ``fully_shard``) keeps FSDP's hooks outside the compiled
    graphs and reuses one compiled graph for identical layers.

    Raises:
        ValueError: The model has no ``model.layers``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"kernels.compile: {type(model).__name__} has no model.layers to compile; unset it")
    for layer in layers:
        layer.compile()


__all__ = [
    "KernelOptions",
    "apply_compile",
    "apply_kernel_options",
    "configure_model_kernels",
    "resolve_kernel_options",
    "supports_hidden_output",
]
