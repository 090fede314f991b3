"""DPO training step: meshforge's preference step vs TRL's DPOTrainer, and each reference choice, on CPU.

One Qwen3 shape (the harness's), one batch of preference pairs and one AdamW setting for every
runner; the policy and its reference start from different weights so the loss is not at ln 2:

* ``trl``: transformers' ``Qwen3ForCausalLM`` in TRL 1.16's ``DPOTrainer._compute_loss`` (its
  concatenated forward: chosen rows then rejected rows, right-padded, with its fused LM head and a
  frozen reference copy), called on a stand-in holding the attributes that method reads;
* ``full_logits`` / ``full_chunked``: meshforge's ``PreferenceStep`` on its own Qwen3 with the same
  weights, each pair one row (two segments), a frozen reference copy; full logits, or the head
  chunk by chunk (``kernels.chunk_loss_size``: no ``[tokens, vocab]`` tensor);
* ``lora``: the same with rank-8 adapters on every linear, the reference being the policy with its
  adapters off (no weights of its own);
* ``full_precompute``: ``full_chunked`` with ``training.pref_ref_logps: precompute``: the reference
  copy's sums computed once (``ReferenceTable``, `train/reference_table.py`), the copy then freed,
  each step reading the table; ``trl_precompute``: TRL's ``precompute_ref_log_probs``, its
  ``compute_ref_log_probs`` once with a reference copy, then ``_compute_loss`` reading
  ``ref_chosen_logps`` / ``ref_rejected_logps`` from the batch. The one-off pass is timed apart
  (``reference_pass_s``) and not in tokens/s.

Steps alternate one by one between runners (the order rotates every repeat). tokens/s counts the
real tokens of both sequences of every pair (no padding), the same for all runners.
``memory_bytes``: ``state`` = policy and reference parameters + gradients + AdamW state after one
step; ``activations`` = bytes autograd holds for backward after one forward of policy and
reference (``SavedTensorLedger``, parameters excluded); ``peak`` their sum. TRL must be importable:
``pip install --no-deps --target build/trl-ref trl==1.16.0`` and put that folder on ``PYTHONPATH``.

Run: ``PYTHONPATH=build/trl-ref python benchmarks/dpo_step.py [--quick] [--pairs 8]``; prints one
JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import time
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from _harness import build_hf, cpu_name, emit, families, median_high, shape_args  # noqa: E402

from meshforge.lora.apply import LoraSettings, apply_lora  # noqa: E402
from meshforge.loss.preference import PreferenceLoss  # noqa: E402
from meshforge.memory.ledger import SavedTensorLedger  # noqa: E402
from meshforge.train.preference import PreferenceStep  # noqa: E402
from meshforge.train.reference_table import ROW_INDEX, ReferenceTable  # noqa: E402

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_pairs(num: int, vocab: int, seed: int = 1) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists of varied lengths (prompt 32-95, answers 16-175)."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    return [(draw(32, 96), draw(16, 176), draw(16, 176)) for _ in range(num)]


def trl_batch(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict[str, torch.Tensor]:
    seqs = [(p + c, len(p)) for p, c, _ in pairs] + [(p + r, len(p)) for p, _, r in pairs]
    width = max(len(s) for s, _ in seqs)
    out = {
        k: torch.zeros(len(seqs), width, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "completion_mask")
    }
    for i, (s, prompt) in enumerate(seqs):
        out["input_ids"][i, : len(s)] = torch.tensor(s)
        out["attention_mask"][i, : len(s)] = 1
        out["completion_mask"][i, prompt : len(s)] = 1
    return out


def pair_rows(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """meshforge's layout: one row per pair (`data/sft/pairwise.py`), labels shifted."""
    width = max(2 * len(p) + len(c) + len(r) for p, c, r in pairs)
    out = {
        k: torch.zeros(len(pairs), width, dtype=torch.long)
        for k in ("input_ids", "segment_ids", "position_ids")
    }
    labels = torch.full((len(pairs), width + 1), -100)
    for i, (p, c, r) in enumerate(pairs):
        a, b = len(p) + len(c), len(p) + len(r)
        out["input_ids"][i, : a + b] = torch.tensor(p + c + p + r)
        out["segment_ids"][i, : a + b] = torch.tensor([1] * a + [2] * b)
        out["position_ids"][i, : a + b] = torch.tensor(list(range(a)) + list(range(b)))
        labels[i, len(p) : a] = torch.tensor(c)
        labels[i, a + len(p) : a + b] = torch.tensor(r)
    out["labels"] = labels[:, 1:]
    return out


def trl_stand_in(policy: torch.nn.Module, reference: torch.nn.Module, beta: float) -> Any:
    """The attributes `DPOTrainer._compute_loss` reads, for one process without accelerate."""
    same = lambda t: t  # noqa: E731
    return types.SimpleNamespace(
        model=policy,
        ref_model=reference,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather=same, gather_for_metrics=same),
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


class DPORunner:
    """One contender: `loss_fn()` runs forward (and, for meshforge, backward) and returns the loss."""

    def __init__(
        self, name: str, params: list[torch.nn.Parameter], reference: list[torch.Tensor], tokens: int
    ):
        self.name = name
        self.params = params
        self.reference = reference  # the reference model's own parameters (none for LoRA)
        self.opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
        self.tokens_per_step = tokens
        self.step_fn: Callable[[], float] = lambda: 0.0
        self.seconds: list[float] = []
        self.first_loss: float | None = None

    def step(self) -> float:
        loss = self.step_fn()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.first_loss is None:
            self.first_loss = loss
        return loss

    def timed(self) -> None:
        t0 = time.perf_counter()
        self.step()
        self.seconds.append(time.perf_counter() - t0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step * len(self.seconds) / sum(self.seconds)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build_runners(num_pairs: int, beta: float) -> tuple[dict[str, DPORunner], dict[str, Any]]:
    family = families()["qwen3"]
    args = shape_args(family, family.shapes["small"])
    pairs = make_pairs(num_pairs, args.vocab_size)
    tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)
    runners: dict[str, DPORunner] = {}
    probes: dict[str, Any] = {}

    passes: dict[str, float] = {}

    def meshforge_runner(name: str, chunk: int | None, lora: bool, precompute: bool = False) -> None:
        policy = family.model_cls(args).train()
        policy.load_state_dict(build_hf(family, args, seed=1).state_dict())
        reference = None
        if lora:
            policy.load_state_dict(build_hf(family, args, seed=0).state_dict())
            apply_lora(
                policy,
                LoraSettings(target_modules=ALL_LINEARS, rank=8, alpha=16, dropout=0.0),
                adapter_dtype=torch.float32,
            )
            with torch.no_grad():  # adapters away from zero, so the policy differs from its reference
                for n, p in policy.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
        else:
            reference = family.model_cls(args).eval().requires_grad_(False)
            reference.load_state_dict(build_hf(family, args, seed=0).state_dict())
        step = PreferenceStep(
            loss=PreferenceLoss(beta=beta),
            lora=lora,
            reference=reference,
            chunk_size=chunk,
            compute_dtype=torch.float32,
            autocast=False,
            device=torch.device("cpu"),
        )
        batch = pair_rows(pairs)
        if precompute:  # one reference pass, then the copy is dropped and the steps read the table
            t0 = time.perf_counter()
            logps = step.reference_forward(policy, batch)
            table = ReferenceTable()
            table.values = torch.stack([logps.chosen, logps.rejected], dim=1).view(len(pairs), 1, 2)
            passes[name] = round(time.perf_counter() - t0, 3)
            step.reference, step.table, reference = None, table, None
            batch[ROW_INDEX] = torch.arange(len(pairs))
        count = step.count_pairs(batch).float()
        params = [p for p in policy.parameters() if p.requires_grad]
        own = list(reference.parameters()) if reference is not None else []
        runner = DPORunner(name, params, own, tokens)
        runner.step_fn = lambda: float(step.forward_backward(policy, batch, count) / count)
        runners[name] = runner
        probes[name] = (lambda: step.forward_backward(policy, batch, count), list(policy.parameters()) + own)

    meshforge_runner("full_logits", None, lora=False)
    meshforge_runner("full_chunked", 1024, lora=False)
    meshforge_runner("lora", 1024, lora=True)
    meshforge_runner("full_precompute", 1024, lora=False, precompute=True)

    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    hf, hf_ref = build_hf(family, args, seed=1), build_hf(family, args, seed=0)
    hf_ref.eval().requires_grad_(False)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")  # what _compute_loss logs
    add_fused_lm_head(hf, outputs=outputs)
    add_fused_lm_head(hf_ref, outputs=outputs)
    me, batch = trl_stand_in(hf, hf_ref, beta), trl_batch(pairs)

    def trl_step() -> float:
        loss = DPOTrainer._compute_loss(me, hf, batch, False)
        loss.backward()
        return float(loss.detach())

    runner = DPORunner("trl", list(hf.parameters()), list(hf_ref.parameters()), tokens)
    runner.step_fn = trl_step
    runners["trl"] = runner
    probes["trl"] = (
        lambda: DPOTrainer._compute_loss(me, hf, batch, False),
        list(hf.parameters()) + runner.reference,
    )

    # TRL's precompute_ref_log_probs: its compute_ref_log_probs once, the copy then dropped.
    hf2, pass_ref = build_hf(family, args, seed=1), build_hf(family, args, seed=0).eval()
    add_fused_lm_head(hf2, outputs=outputs)
    add_fused_lm_head(pass_ref, outputs=outputs)
    me2 = trl_stand_in(hf2, pass_ref, beta)
    me2.accelerator.autocast = contextlib.nullcontext
    t0 = time.perf_counter()
    ref_chosen, ref_rejected = DPOTrainer.compute_ref_log_probs(me2, pass_ref, batch)
    passes["trl_precompute"] = round(time.perf_counter() - t0, 3)
    me2.ref_model, me2.precompute_ref_logps = None, True
    del pass_ref
    batch2 = {**batch, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}

    def trl_precompute_step() -> float:
        loss = DPOTrainer._compute_loss(me2, hf2, batch2, False)
        loss.backward()
        return float(loss.detach())

    runner = DPORunner("trl_precompute", list(hf2.parameters()), [], tokens)
    runner.step_fn = trl_precompute_step
    runners["trl_precompute"] = runner
    probes["trl_precompute"] = (
        lambda: DPOTrainer._compute_loss(me2, hf2, batch2, False),
        list(hf2.parameters()),
    )
    return runners, {"pairs": num_pairs, "tokens_per_step": tokens, "probes": probes, "passes": passes}


def memory_bytes(runner: DPORunner, probe: tuple[Callable[[], Any], list[torch.Tensor]]) -> dict[str, int]:
    forward, all_params = probe
    ledger = SavedTensorLedger()
    ledger.exclude(all_params)
    with ledger.recording():
        out = forward()
    if out.requires_grad:  # TRL's loss (meshforge's step has run its backward already)
        out.backward()
    runner.opt.step()
    runner.opt.zero_grad(set_to_none=True)
    state = _bytes(all_params) + _bytes(
        v for s in runner.opt.state.values() for v in s.values() if v.dim() > 0
    )
    grads = _bytes(p for p in runner.params)  # the gradients' bytes equal the trained parameters'
    return {
        "parameters": _bytes(all_params),
        "reference_parameters": _bytes(runner.reference),
        "state": state + grads,
        "activations": ledger.device_bytes,
        "peak": state + grads + ledger.device_bytes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps each")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    runners, info = build_runners(opts.pairs, opts.beta)
    memory = {name: memory_bytes(r, info["probes"][name]) for name, r in runners.items()}
    warmup, repeats = (1, 3) if opts.quick else (2, 8)
    for r in runners.values():
        for _ in range(warmup):
            r.step()
    names = list(runners)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runners[name].timed()
    trl = runners["trl"]
    result: dict[str, Any] = {
        "benchmark": "dpo_step",
        "date": _dt.date.today().isoformat(),
        "cpu": cpu_name(),
        "threads": opts.threads,
        "pairs": info["pairs"],
        "tokens_per_step": info["tokens_per_step"],
        "tokens_per_s": {n: round(r.tokens_per_s, 1) for n, r in runners.items()},
        "over_trl_tokens_per_s": {
            n: round(r.tokens_per_s / trl.tokens_per_s, 3) for n, r in runners.items() if n != "trl"
        },
        "over_trl_median_of_pairs": {
            n: round(median_high([t / o for o, t in zip(r.seconds, trl.seconds, strict=True)]), 3)
            for n, r in runners.items()
            if n != "trl"
        },
        "memory_bytes": memory,
        "over_trl_peak": {
            n: round(m["peak"] / memory["trl"]["peak"], 3) for n, m in memory.items() if n != "trl"
        },
        "first_loss": {n: round(r.first_loss or 0.0, 5) for n, r in runners.items()},
        "reference_pass_s": info["passes"],
        "full_precompute_over_trl_precompute": {
            "tokens_per_s": round(
                runners["full_precompute"].tokens_per_s / runners["trl_precompute"].tokens_per_s, 3
            ),
            "peak": round(memory["full_precompute"]["peak"] / memory["trl_precompute"]["peak"], 3),
        },
    }
    emit(result)


if __name__ == "__main__":
    main()
