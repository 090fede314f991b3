"""What the benchmark scripts share: the step loop, medians, the matmul probe, shapes, families.

Every script in this folder imports it as ``_harness``: run them from the repository root as
``python benchmarks/<script>.py`` with meshforge installed, and Python puts the script's own
folder first on ``sys.path``, so no script edits it. Arrows point one way: every script imports
this module; ``step_throughput.py`` also imports its two parts (``step_variants.py``, the
contenders; ``compile_time.py``, the compile-time children) and hands ``--family mamba3`` /
``step3p5`` to ``mamba3_throughput.py`` / ``alone_throughput.py``; nothing imports
``step_throughput.py`` back. ``tests/unit/test_benchmarks_layout.py`` checks this.

Light at import: torch, transformers and the meshforge model classes are imported where they
are used (``families()`` builds the family table on first call), so a data benchmark that only
needs ``emit`` or ``median_high`` does not pay for them.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The repository root (configs/, tests/data/, src/), for scripts that read its files.
REPO = Path(__file__).resolve().parents[1]

# --- reporting --------------------------------------------------------------------------------


def emit(record: dict[str, Any], *, file: IO[str] | None = None) -> None:
    """Print one case's result as one JSON line (the benchmarks' output format), flushed."""
    print(json.dumps(record), file=file or sys.stdout, flush=True)


def utc_now() -> str:
    """The time a result was measured, as the README tables quote it."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rss_mb() -> float:
    """Peak resident set of this process in MB.

    Linux's ``VmHWM`` is per address space, so a child started with exec does not
    inherit the parent's peak (``ru_maxrss`` does); other systems fall back to it.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- statistics and the matmul probe ----------------------------------------------------------


def median_high(values: Sequence[float]) -> float:
    """The upper of the two middle values for an even count (a measured sample, never a mean)."""
    return statistics.median_high(values)


def mm_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """GFLOP/s of one ``torch.mm(a, b)``: a peak sample taken under the load of the moment."""
    import torch

    t0 = time.perf_counter()
    torch.mm(a, b)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t0) / 1e9


def measure_mm_peak(size: int = 2048, reps: int = 4, trials: int = 3) -> float:
    """Best fp32 ``torch.mm`` GFLOP/s over a few trials of ``reps`` square products."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        dt = time.perf_counter() - t0
        best = max(best, 2 * size**3 * reps / dt / 1e9)
    return best


# --- one training step ------------------------------------------------------------------------


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies of ``logits`` (batch, seq, vocab) against flat ``labels``."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels, reduction="sum", ignore_index=-100)


@dataclass(frozen=True)
class StepFns:
    """How one contender runs: ``forward(input_ids) -> output``, ``loss(output, labels) -> sum``."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    compiled: bool = False


def meshforge_eager(model: torch.nn.Module) -> StepFns:
    return StepFns(lambda ids: model(ids), summed_cross_entropy)


def transformers_eager(model: torch.nn.Module) -> StepFns:
    return StepFns(lambda ids: model(input_ids=ids, use_cache=False).logits, summed_cross_entropy)


class Runner:
    """One model, its AdamW and the shared batch; ``step()`` is one training step.

    ``fns`` selects the variant; without it the model runs eagerly (transformers models
    through ``.logits`` when ``is_hf``).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        is_hf: bool,
        adamw: str,
        fns: StepFns | None = None,
    ):
        import torch

        self.name = name
        self.model = model
        self.is_hf = is_hf
        self.fns = fns or (transformers_eager(model) if is_hf else meshforge_eager(model))
        self.input_ids = batch["input_ids"]
        self.labels = batch["labels"].flatten()
        self.num_tokens = int((self.labels != -100).sum())
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[adamw]
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **impl)
        self.seconds = 0.0
        self.block_seconds: list[float] = []
        self.cpu_seconds = 0.0
        self.tokens = 0
        self.losses: list[float] = []
        self.warmup_losses: list[float] = []

    def step(self) -> float:
        out = self.fns.forward(self.input_ids)
        loss = self.fns.loss(out, self.labels) / self.num_tokens
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def warmup(self, steps: int) -> None:
        for _ in range(steps):
            self.warmup_losses.append(self.step())

    @property
    def first_loss(self) -> float:
        return (self.warmup_losses or self.losses)[0]

    def timed_block(self, steps: int) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.losses.append(self.step())
        dt = time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - c0
        self.seconds += dt
        self.block_seconds.append(dt)
        self.tokens += steps * self.input_ids.numel()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def pair_median(reference: Runner, other: Runner) -> float:
    """Median over repeats of reference/other block time: the two ran next to each other."""
    return median_high([r / o for r, o in zip(reference.block_seconds, other.block_seconds)])


# --- shapes and families ----------------------------------------------------------------------

SHAPES = {
    # Overhead-bound: small matrices, elementwise work and Python dispatch weigh a lot.
    "small": dict(
        args=dict(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        batch=8,
        seq=256,
        target_ratio=1.3,
        target_peak=None,
    ),
    # Compute-bound: matmuls dominate.
    "large": dict(
        args=dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=False,
        ),
        batch=2,
        seq=1024,
        target_ratio=1.05,
        target_peak=0.90,
    ),
}

# Tiny-ish MoE shapes: the same trunk as the dense ``small`` shape (hidden 256, 4 layers,
# batch 8 x seq 256, vocab 8192) with 8 routed experts, 2 per token.
MOE_SHAPES = {
    "qwen3_moe": {
        "small": dict(
            args=dict(
                vocab_size=8192,
                hidden_size=256,
                intermediate_size=768,
                moe_intermediate_size=256,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                tie_word_embeddings=False,
            ),
            batch=8,
            seq=256,
            target_ratio=None,
            target_peak=None,
        ),
    },
    "deepseek_v3": {
        # MLA with q/kv LoRA ranks, one dense layer first, 8 routed experts in 2 groups
        # (1 kept), 1 shared expert, sigmoid scoring with the correction bias.
        "small": dict(
            args=dict(
                vocab_size=8192,
                hidden_size=256,
                intermediate_size=768,
                moe_intermediate_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=128,
                kv_lora_rank=64,
                qk_nope_head_dim=32,
                qk_rope_head_dim=32,
                v_head_dim=32,
                n_routed_experts=8,
                n_shared_experts=1,
                n_group=2,
                topk_group=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                routed_scaling_factor=2.5,
                num_nextn_predict_layers=0,
                tie_word_embeddings=False,
            ),
            batch=8,
            seq=256,
            target_ratio=None,
            target_peak=None,
        ),
    },
}

# MiniMax-M2 on the same shape: every layer sparse, 8 experts of 256, top-2, RoPE on half of each head.
MOE_SHAPES["minimax_m2"] = {"small": {**MOE_SHAPES["qwen3_moe"]["small"], "args": dict(
    vocab_size=8192, hidden_size=256, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)}}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One model family: our args and model classes, transformers' config and model class names."""

    args_cls: type
    model_cls: type
    hf_config: str
    hf_model: str
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)


# The families measured against transformers' own model (``families()`` has their classes).
FAMILY_NAMES = ("qwen3", "qwen3_moe", "deepseek_v3", "minimax_m2")


@cache
def families() -> dict[str, Family]:
    """``FAMILY_NAMES`` -> ``Family`` (imports the meshforge model modules on first call)."""
    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from meshforge.models.minimax_m2.args import MiniMaxM2Args
    from meshforge.models.minimax_m2.model import MiniMaxM2ForCausalLM
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import Qwen3ForCausalLM
    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
    from meshforge.models.qwen3_moe.model import Qwen3MoeForCausalLM

    table = {
        "qwen3": Family(Qwen3Args, Qwen3ForCausalLM, "Qwen3Config", "Qwen3ForCausalLM", SHAPES),
        "qwen3_moe": Family(
            Qwen3MoeArgs,
            Qwen3MoeForCausalLM,
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            MOE_SHAPES["qwen3_moe"],
        ),
        "deepseek_v3": Family(
            DeepseekV3Args,
            DeepseekV3ForCausalLM,
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            MOE_SHAPES["deepseek_v3"],
        ),
        "minimax_m2": Family(
            MiniMaxM2Args,
            MiniMaxM2ForCausalLM,
            "MiniMaxM2Config",
            "MiniMaxM2ForCausalLM",
            MOE_SHAPES["minimax_m2"],
        ),
    }
    assert tuple(table) == FAMILY_NAMES
    return table


def build_hf(family: Family, args: Any, seed: int = 0) -> torch.nn.Module:
    """transformers' ``*ForCausalLM`` of ``family`` (sdpa attention, no KV cache) for ``args``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, family.hf_config)(**{**args.to_hf_dict(), "use_cache": False})
    config._attn_implementation = "sdpa"
    return getattr(transformers, family.hf_model)(config).float().train()


def make_pair(family: Family, args: Any, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers model and ours with identical weights."""
    hf = build_hf(family, args, seed)
    ours = family.model_cls(args).train()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def shape_args(family: Family, spec: dict[str, Any]) -> Any:
    return family.args_cls(**spec["args"], max_position_embeddings=max(2048, spec["seq"]), rope_theta=1e6)


def shape_batch(spec: dict[str, Any], vocab_size: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


# --- data -------------------------------------------------------------------------------------


def write_corpus(path: Path, num_docs: int = 300, *, min_words: int = 20, spread: int = 30) -> Path:
    """A small deterministic English-like JSONL corpus (the one the tests' conftest writes).

    Document ``i`` has ``min_words + i % spread`` words, so lengths vary without randomness.
    """
    words = (
        "the model reads a file and returns the value of each key in order while the loader keeps "
        "its position so that a resumed run sees exactly the same samples as before"
    ).split()
    with path.open("w") as f:
        for i in range(num_docs):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(min_words + i % spread))
            f.write(json.dumps({"text": f"Document {i}: {text}."}) + "\n")
    return path
