"""Reference-style operator words for ``recompute.exclude_op`` and the aten kernels they mean (light).

A selective-checkpoint policy sees the kernels autograd records, after composite operators are
decomposed: ``F.linear`` runs as ``aten.mm``/``aten.addmm``, attention as one of the fused
``scaled_dot_product`` kernels (which one depends on the device and the mask). The reference
names operators by what they do (MindSpore's ``MatMul``, ``FlashAttentionScore``); each word
here lists the kernels it stands for. Kept torch-free so that config checks can read it.
"""

from __future__ import annotations

_MATMUL = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
_ATTENTION = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)

#: Lower-cased word -> the aten operators (every overload) it keeps.
OP_ALIASES: dict[str, tuple[str, ...]] = {
    "matmul": _MATMUL,
    "linear": _MATMUL,
    "batchmatmul": ("aten.bmm", "aten.baddbmm"),
    "flash_attention": _ATTENTION,
    "flashattentionscore": _ATTENTION,
    "sdpa": _ATTENTION,
    "scaled_dot_product_attention": _ATTENTION,
    "softmax": ("aten._softmax",),
    "silu": ("aten.silu",),
}


def split_every(entry: str) -> tuple[str, int]:
    """``"matmul/2"`` -> ``("matmul", 2)``: keep the output of one call in every N (1: every call).

    torchtitan's selective op checkpointing keeps the outputs of every second matmul of a layer
    (the first, third, ...): a middle ground between keeping them all and recomputing them all.

    Raises:
        ValueError: the part after ``/`` is not a whole number of at least 1.
    """
    name, slash, every = entry.strip().partition("/")
    if not slash:
        return name, 1
    if not every.strip().isdigit() or int(every) < 1:
        raise ValueError(f"{entry!r}: after '/' write how often a call's output is kept, a whole number >= 1")
    return name.strip(), int(every)


def is_operator_name(name: str) -> bool:
    """Whether ``name`` has the shape of an operator entry (an alias, ``aten.x[.overload]`` or
    ``x``, optionally followed by ``/N``)."""
    try:
        name, _every = split_every(name)
    except ValueError:
        return False
    if name.lower() in OP_ALIASES:
        return True
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    return 1 <= len(parts) <= 2 and all(part.isidentifier() for part in parts)
