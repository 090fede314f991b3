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
* ``pre_tokens``: a banded causal window on every attention layer: query i attends keys j
  with ``i - pre_tokens <= j <= i`` (within its document in packed rows; a family's own
  sliding window and this one: the narrower applies). The default, 1048576, is MindSpeed's
  "every earlier token": no window. Torch's flash SDPA kernel takes no window, so with one
  ``use_flash_attn: true`` is refused and ``auto`` runs SDPA with the band mask. Families
  without attention layers (mamba3) and the generic path refuse it. ``next_tokens`` (later
  keys) stays 0: a causal LM token must not see the tokens it is trained to predict
  (``models/config.py`` refuses any other value).
* ``fix_router``: fixed, balanced routing for performance tuning: token ``i`` (flattened over
  batch and sequence) goes to experts ``(i * k + j) mod E`` for ``j < k``; the routing weights
  are the router probabilities of those experts (renormalised when ``norm_topk_prob``), so
  the router still gets a gradient. MoE families only.
* ``compile``: ``torch.compile`` of every decoder layer (before FSDP wraps it) and of the loss
  steps; ``auto`` (the default) decides by device and run length (``models/common/compile.py``).
* ``chunk_loss_size``: cross-entropy over sequence chunks, logits recomputed in backward
  (``meshforge.loss.cross_entropy``).
* ``fused_linear_cross_entropy``: the LM head and the loss chunk by chunk with the gradient
  taken in the forward (``meshforge.loss.lm``); when ``auto`` turns it on is
  :func:`fused_loss_on`'s rule, which the trainer and the memory planner both ask.

Light module: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from meshforge.loss.lm import LMLoss
    from meshforge.models.common.compile import RunLength
    from meshforge.models.config import KernelsConfig

# At 32,768 entries and more the full logits outweigh the hidden states 8x and more at any
# hidden size a model of that vocabulary has, and the fused loss is as fast as the plain one.
FUSED_CE_MIN_VOCAB = 32768

# kernels.pre_tokens' default, MindSpeed's "every earlier token": no window at or above it.
PRE_TOKENS_ALL = 1048576

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
        compile: ``torch.compile`` each decoder layer and the loss steps.
        compile_backend: The ``torch.compile`` backend.
        compile_auto: ``compile`` was decided by ``auto`` (a model without ``model.layers``
            then trains eagerly instead of failing).
        compile_reason: The start-up log's sentence about the compile decision.
        chunk_loss_size: Tokens per cross-entropy chunk (the recomputing chunked loss, or the
            fused loss's chunk when ``fused_ce``), or None.
        fused_ce: The fused linear cross-entropy.
        fused_ce_auto: ``fused_ce`` was decided by ``auto`` (a model that cannot return its
            hidden states turns it off instead of failing).
        vocab_size: The model's vocabulary (the fused loss's default chunk), or None.
        gdn_chunk_size: Chunk length of the chunked Gated DeltaNet (qwen3_next), or None when
            the config does not set it (the layers' default, 64).
        pre_tokens: Earlier keys each query attends (``kernels.pre_tokens``), or None at the
            default (every earlier key).
    """

    flash_attn: bool = False
    flash_attn_strict: bool = False
    fused_rmsnorm: bool | None = None
    fused_rope: bool = False
    grouped_mm: bool = False
    fix_router: bool = False
    compile: bool = False
    compile_auto: bool = False
    compile_backend: str = "inductor"
    compile_reason: str = ""
    chunk_loss_size: int | None = None
    fused_ce: bool = False
    fused_ce_auto: bool = False
    vocab_size: int | None = None
    gdn_chunk_size: int | None = None
    pre_tokens: int | None = None

    def model_switches(self) -> dict[str, bool]:
        """Config key -> on, for the switches a model must honour in ``configure_kernels``."""
        return {
            "use_flash_attn": self.flash_attn,
            "use_fused_rmsnorm": self.fused_rmsnorm is not None,
            "use_fused_rotary_pos_emb": self.fused_rope,
            "moe_grouped_gemm": self.grouped_mm,
            "fix_router": self.fix_router,
            "pre_tokens": self.pre_tokens is not None,
        }

    def lm_loss(self) -> LMLoss:
        """The run's loss formulation (:class:`meshforge.loss.lm.LMLoss`)."""
        from meshforge.loss.lm import select_lm_loss

        return select_lm_loss(
            fused=self.fused_ce,
            chunk_loss_size=self.chunk_loss_size,
            vocab_size=self.vocab_size,
            compile_backend=self.compile_backend if self.compile else None,
        )


def fused_loss_on(
    setting: bool | Literal["auto"],
    *,
    vocab_size: int | None,
    chunk_loss_size: int | None,
    loss_parallel: bool,
    hidden_output: bool = True,
) -> bool:
    """Whether a run computes its loss with the fused linear cross-entropy.

    ``true`` and ``false`` are taken as written (``true`` on a model without hidden output is
    refused by :func:`configure_model_kernels`). ``auto`` is on when all of these hold:

    * the vocabulary has at least :data:`FUSED_CE_MIN_VOCAB` entries (below it the logits are
      small enough that the plain loss costs little memory);
    * the model returns its normed hidden states and has a bias-free ``lm_head``
      (:func:`supports_hidden_output`), since the fused loss applies the head itself;
    * TP's loss parallelism is off: with it each rank already holds only its vocabulary slice
      of the logits, and the fused loss would gather the whole head;
    * ``chunk_loss_size`` is unset: written alone it asks for the recomputing chunked loss.

    Args:
        setting: ``kernels.fused_linear_cross_entropy``.
        vocab_size: The model's output vocabulary; None (unknown) keeps ``auto`` off.
        chunk_loss_size: ``kernels.chunk_loss_size``.
        loss_parallel: ``parallelism.tensor_parallel > 1`` with ``enable_loss_parallel``.
        hidden_output: What :func:`supports_hidden_output` says of the model; True when the
            model is not known yet (:func:`configure_model_kernels` then turns ``auto`` off
            for a model that cannot).
    """
    if setting != "auto":
        return bool(setting)
    return (
        vocab_size is not None
        and vocab_size >= FUSED_CE_MIN_VOCAB
        and hidden_output
        and not loss_parallel
        and chunk_loss_size is None
    )


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
    vocab_size: int | None = None,
    run: RunLength | None = None,
    loss_parallel: bool = False,
    hidden_output: bool = True,
) -> KernelOptions:
    """Turn the ``kernels`` config section into :class:`KernelOptions` for ``device``.

    Args:
        kernels: The validated ``KernelsConfig`` (``true``/``false``/``"auto"`` values).
        device: The device this process trains on.
        compute_dtype: The model's compute dtype (flash attention needs fp16/bf16).
        warn: Receives one ``warning: kernels.<key>: ...`` line for each switch set to true
            that cannot run on ``device`` (it is then off).
        vocab_size: The model's vocabulary (``fused_linear_cross_entropy: auto``); None: off.
        run: The run's length, for ``compile: auto`` on the CPU; None: auto is off there.
        loss_parallel: TP with ``enable_loss_parallel`` (:func:`fused_loss_on`).
        hidden_output: Whether the model returns its hidden states (:func:`fused_loss_on`);
            True when the model is not known yet.

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

    from meshforge.models.common.compile import CompileDecision, RunLength, decide_compile

    if run is None and kernels.compile == "auto" and device.type == "cpu":
        decision = CompileDecision(False, "kernels.compile: auto -> off (cpu; run length not given)")
    else:
        decision = decide_compile(
            kernels.compile, device_type=device.type, run=run or RunLength(None, 0, None)
        )
    fused = kernels.fused_linear_cross_entropy
    fused_on = fused_loss_on(
        fused,
        vocab_size=vocab_size,
        chunk_loss_size=kernels.chunk_loss_size,
        loss_parallel=loss_parallel,
        hidden_output=hidden_output,
    )
    return KernelOptions(
        flash_attn=flash_on,
        flash_attn_strict=flash is True and flash_on,
        fused_rmsnorm=fused_norm,
        fused_rope=False,
        grouped_mm=grouped,
        fix_router=kernels.fix_router,
        compile=decision.on,
        compile_auto=kernels.compile == "auto",
        compile_backend=kernels.compile_backend,
        compile_reason=decision.reason,
        chunk_loss_size=kernels.chunk_loss_size,
        fused_ce=fused_on,
        fused_ce_auto=fused == "auto",
        vocab_size=vocab_size,
        gdn_chunk_size=kernels.gdn_chunk_size if "gdn_chunk_size" in kernels.model_fields_set else None,
        pre_tokens=kernels.pre_tokens if kernels.pre_tokens < PRE_TOKENS_ALL else None,
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
            without MoE blocks, ``kernels.pre_tokens`` on one without attention layers or
            with ``kernels.use_flash_attn: true``.
    """
    from meshforge.models.common.attention import Attention, AttentionBase
    from meshforge.models.common.moe import GroupedExperts, TopKRouter
    from meshforge.models.common.norms import RMSNorm

    modules = list(model.modules())
    experts = [m for m in modules if isinstance(m, GroupedExperts)]
    routers = [m for m in modules if isinstance(m, TopKRouter)]
    if options.fix_router and not routers:
        raise ValueError(f"kernels.fix_router: {family} has no MoE router (a dense model); unset it")
    if options.grouped_mm and not experts:
        raise ValueError(f"kernels.moe_grouped_gemm: {family} has no MoE experts (a dense model); unset it")
    attention = [m for m in modules if isinstance(m, AttentionBase)]
    if options.pre_tokens is not None and not attention:
        raise ValueError(f"kernels.pre_tokens: {family} has no attention layers; unset it")
    if options.pre_tokens is not None and options.flash_attn_strict:
        raise ValueError(
            f"kernels.use_flash_attn: true: torch's flash attention kernel takes no window, and "
            f"kernels.pre_tokens ({options.pre_tokens}) asks for one; set use_flash_attn to auto to run "
            "SDPA with the band mask"
        )
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
    for module in attention:
        module.pre_tokens = options.pre_tokens
    for module in experts:
        module.use_grouped_mm = options.grouped_mm
    for module in routers:
        module.fixed = options.fix_router


def configure_model_kernels(model: nn.Module, options: KernelOptions, *, family: str) -> KernelOptions:
    """Hand ``options`` to ``model.configure_kernels``, or refuse switches it cannot take.

    Returns:
        The options the run uses: ``fused_linear_cross_entropy: auto`` is turned off for a
        model that cannot return its hidden states (:func:`fused_loss_on`'s clause, for
        options resolved before the model was known), and ``compile: auto`` for one without
        ``model.layers``.

    Raises:
        ValueError: A switch is on and the family has no ``configure_kernels``, or
            ``chunk_loss_size`` / ``fused_linear_cross_entropy: true`` is set and the model
            cannot return hidden states.
    """
    configure = getattr(model, "configure_kernels", None)
    if callable(configure):
        configure(options)
    else:
        for key, on in options.model_switches().items():
            if on:
                raise ValueError(f"kernels.{key}: not supported by the {family} model family; unset it")
    if options.compile and options.compile_auto and not _has_decoder_layers(model):
        options = dataclasses.replace(
            options,
            compile=False,
            compile_reason=f"kernels.compile: auto -> off ({type(model).__name__} has no model.layers to compile)",
        )
    hidden = supports_hidden_output(model)
    if options.fused_ce and not hidden:
        if options.fused_ce_auto:
            return dataclasses.replace(options, fused_ce=False)
        raise ValueError(
            f"kernels.fused_linear_cross_entropy: the {family} model does not expose its final hidden states "
            "(forward(..., return_hidden=True) and a bias-free lm_head); set it to auto or false"
        )
    if options.chunk_loss_size is not None and not hidden:
        raise ValueError(
            f"kernels.chunk_loss_size: the {family} model does not expose its final hidden states "
            "(forward(..., return_hidden=True) and a bias-free lm_head); unset it"
        )
    return options


def _has_decoder_layers(model: nn.Module) -> bool:
    from meshforge.models.common.compile import decoder_layers

    try:
        decoder_layers(model)
    except ValueError:
        return False
    return True


def supports_hidden_output(model: nn.Module) -> bool:
    """Whether ``model`` can feed the chunked loss: ``return_hidden`` and a bias-free ``lm_head``."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "bias", None) is not None:
        return False
    return "return_hidden" in inspect.signature(model.forward).parameters


def apply_compile(
    model: nn.Module,
    *,
    backend: str = "inductor",
    warn: Callable[[str], None] = print,
    log: Callable[[str], None] = lambda line: None,
) -> list[str]:
    """``torch.compile`` every decoder layer in place, before FSDP (``models/common/compile.py``); the layer names."""
    from meshforge.models.common.compile import apply_compile as compile_layers

    return compile_layers(model, backend=backend, warn=warn, log=log)


__all__ = [
    "FUSED_CE_MIN_VOCAB",
    "PRE_TOKENS_ALL",
    "KernelOptions",
    "apply_compile",
    "apply_kernel_options",
    "configure_model_kernels",
    "fused_loss_on",
    "resolve_kernel_options",
    "supports_hidden_output",
]
