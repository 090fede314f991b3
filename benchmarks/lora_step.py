"""LoRA training step: meshforge's adapters vs full fine-tuning and vs transformers + peft, on CPU.

Three runners share one Qwen3 shape, one batch and one AdamW setting (``fused=True``):

* ``full``: meshforge's model, every parameter trained;
* ``lora``: the same model with meshforge's adapters (``meshforge.lora.apply_lora``): base frozen;
* ``peft``: transformers' ``Qwen3ForCausalLM`` with the same weights wrapped by
  ``peft.get_peft_model`` with the same rank, alpha, dropout 0 and target modules.

Steps alternate one by one between the runners (the order rotates every repeat) so background
load on a shared machine hits them alike; tokens/s is over all timed steps, and
``ratio_median_of_pairs`` the median of neighbouring steps' time ratios.

Memory is counted exactly rather than sampled: ``state`` = parameters + gradients + AdamW state
after one step (bytes of every tensor), ``activations`` = bytes autograd holds for backward after
one forward and loss (``SavedTensorLedger``, parameters excluded), ``peak`` = their sum (the
point of a step where both are alive). LoRA's target is optimizer + gradient bytes reduced in
proportion to the trainable share.

Run: ``python benchmarks/lora_step.py [--quick] [--shape small|large] [--target qv|all]``;
prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import Runner, cpu_name, emit, families, make_pair, median_high, shape_args, shape_batch  # noqa: E402

from meshforge.lora.apply import LoraSettings, apply_lora  # noqa: E402
from meshforge.memory.ledger import SavedTensorLedger  # noqa: E402

TARGETS = {
    "qv": ("q_proj", "v_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def build_runners(shape: str, target: str, rank: int) -> dict[str, Runner]:
    """The three runners on identical base weights (ours loads transformers' state dict)."""
    import peft

    family = families()["qwen3"]
    spec = family.shapes[shape]
    args = shape_args(family, spec)
    batch = shape_batch(spec, args.vocab_size)
    hf, full = make_pair(family, args)
    _, ours = make_pair(family, args)
    apply_lora(
        ours,
        LoraSettings(target_modules=TARGETS[target], rank=rank, alpha=2 * rank, dropout=0.0),
        adapter_dtype=torch.float32,
    )
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGETS[target])
    )
    wrapped = peft.get_peft_model(hf, config)
    return {
        "full": Runner("full", full, batch, is_hf=False, adamw="fused"),
        "lora": Runner("lora", ours, batch, is_hf=False, adamw="fused"),
        "peft": Runner("peft", wrapped, batch, is_hf=True, adamw="fused"),
    }


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_bytes(runner: Runner) -> dict[str, int]:
    """State after one step (parameters, gradients, AdamW moments) and activations of one forward."""
    model = runner.model
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        if runner.is_hf:
            logits = model(input_ids=runner.input_ids, use_cache=False).logits
        else:
            logits = model(runner.input_ids)
        loss = (
            F.cross_entropy(logits.flatten(0, 1).float(), runner.labels, reduction="sum") / runner.num_tokens
        )
    activations = ledger.device_bytes
    loss.backward()
    grads = _tensor_bytes(p.grad for p in model.parameters())
    runner.opt.step()
    optimizer = _tensor_bytes(v for state in runner.opt.state.values() for v in state.values() if v.dim() > 0)
    runner.opt.zero_grad(set_to_none=True)
    params = _tensor_bytes(model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "peak": params + grads + optimizer + activations,
        "trainable_share": trainable / total,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["small", "large"], default="small")
    parser.add_argument("--target", choices=list(TARGETS), default="qv")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 4 timed steps each")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    warmup, repeats = (2, 4) if opts.quick else (3, 10)
    runners = build_runners(opts.shape, opts.target, opts.rank)
    memory = {name: memory_bytes(r) for name, r in runners.items()}
    for r in runners.values():
        for _ in range(warmup):
            r.step()
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            runner = runners[name]
            runner.timed_block(1)
            times[name].append(runner.block_seconds[-1])
    result: dict[str, Any] = {
        "benchmark": "lora_step",
        "date": _dt.date.today().isoformat(),
        "cpu": cpu_name(),
        "threads": opts.threads,
        "shape": opts.shape,
        "target": opts.target,
        "rank": opts.rank,
        "tokens_per_s": {name: round(r.tokens_per_s, 1) for name, r in runners.items()},
        "lora_over_peft_tokens_per_s": round(runners["lora"].tokens_per_s / runners["peft"].tokens_per_s, 3),
        "lora_over_peft_median_of_pairs": round(
            median_high([p / o for o, p in zip(times["lora"], times["peft"], strict=True)]), 3
        ),
        "lora_over_full_tokens_per_s": round(runners["lora"].tokens_per_s / runners["full"].tokens_per_s, 3),
        "memory_bytes": memory,
        "lora_over_peft_peak": round(memory["lora"]["peak"] / memory["peft"]["peak"], 3),
        "lora_over_full_grad_and_optimizer": round(
            (memory["lora"]["gradients"] + memory["lora"]["optimizer"])
            / (memory["full"]["gradients"] + memory["full"]["optimizer"]),
            4,
        ),
        "losses_first_step": {name: round(r.losses[0], 5) for name, r in runners.items()},
    }
    emit(result)


if __name__ == "__main__":
    main()
