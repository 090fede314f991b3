"""Activation memory and step time of recompute and swap, against transformers' checkpointing, on CPU.

A Qwen3 where activations dominate (hidden 512, 8 layers, 8 heads / 4 kv, head_dim 64, ffn
1536, vocab 32000 tied, micro-batch 4, chunked loss of 1024 tokens, fp32), one child process
per case, all from the same initial weights (transformers' initialisation, saved once by the
parent and assigned by each child) and the same batch:

* meshforge ``none``, ``full`` (every layer), ``select_attention``, ``select_mlp`` (every layer's
  attention or MLP recomputed) and ``swap`` (every layer's saved tensors to host memory; on the
  CPU a host copy, so this measures the hooks' and copies' cost, not a saving of RAM);
* transformers ``hf`` and ``hf_gc`` (``gradient_checkpointing_enable()``) on the same model.

Each child runs one warm-up step under the saved-tensor ledger (the bytes autograd holds for
backward, and the bytes swapped to host), then timed steps (forward, chunked loss / tokens,
backward, fused AdamW step); it reports the median step time and ``VmHWM`` (peak resident set).
The parent also asks the planner (``memory.estimate``, a trace on fake tensors) for each
meshforge case's saved bytes.

Run: ``python benchmarks/activation_memory.py [--seq 1024] [--batch 4] [--steps 2] [--threads 2]``.
Prints one JSON line per case, then one with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _harness import emit, rss_mb  # noqa: E402

SHAPE = dict(
    vocab_size=32_000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
)
CHUNK = 1024
LAYERS = [f"0-{SHAPE['num_hidden_layers'] - 1}"]
CASES: dict[str, dict] = {
    "none": {},
    "full": {"recompute": {"mode": "full", "full_recompute_layer": LAYERS}},
    "select_attention": {"recompute": {"mode": "select", "select_module": {"attention": LAYERS}}},
    "select_mlp": {"recompute": {"mode": "select", "select_module": {"mlp": LAYERS}}},
    # The reference's rule: the last swapped layer + default_prefetch < num_layers.
    "swap": {"swap": {"enable": True, "default_prefetch": 1, "layer_swap": [{"layers": ["0-6"]}]}},
    "hf": {},
    "hf_gc": {},
}


def _args(seq: int):
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(**SHAPE, max_position_embeddings=max(seq, 2048), rope_theta=1e6)


def _build_hf(seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**_args(seq).to_hf_dict(), "use_cache": False})
    config._attn_implementation = "sdpa"
    return transformers.Qwen3ForCausalLM(config).float().train()


def _settings(case: str):
    from meshforge.memory.apply import ActivationSettings
    from meshforge.memory.config import RecomputeConfig, SwapConfig

    spec = CASES[case]
    return ActivationSettings(
        recompute=RecomputeConfig(**spec.get("recompute", {})), swap=SwapConfig(**spec.get("swap", {}))
    )


def _child(case: str, seq: int, batch: int, steps: int, weights: str) -> dict:
    import torch
    import transformers  # noqa: F401  (every child pays the same import)

    from meshforge.loss.cross_entropy import chunked_cross_entropy_sum, cross_entropy_sum
    from meshforge.memory.apply import apply_activation_memory
    from meshforge.memory.ledger import SavedTensorLedger
    from meshforge.models.qwen3.model import Qwen3ForCausalLM

    if case.startswith("hf"):
        model = _build_hf(seq)
        if case == "hf_gc":
            model.gradient_checkpointing_enable()
    else:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(_args(seq))
        state = torch.load(weights, weights_only=True)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.train()
        del state
        settings = _settings(case)
        if settings.active:
            apply_activation_memory(model, settings, num_layers=SHAPE["num_hidden_layers"], tp_mesh=None)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq + 1), generator=gen)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    head = model.lm_head

    def step(ledger: SavedTensorLedger | None) -> float:
        if ledger is not None:
            with ledger.recording():
                loss_sum = forward()
        else:
            loss_sum = forward()
        loss = loss_sum / labels.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def forward():
        if case.startswith("hf"):
            hidden = model.model(input_ids=inputs).last_hidden_state
            return chunked_cross_entropy_sum(hidden, head.weight, labels, chunk_size=CHUNK)
        if CHUNK:
            hidden = model(inputs, return_hidden=True)
            return chunked_cross_entropy_sum(hidden, head.weight, labels, chunk_size=CHUNK)
        return cross_entropy_sum(model(inputs), labels)

    before = rss_mb()
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    losses = [step(ledger)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step(None))
        times.append(time.perf_counter() - start)
    return {
        "saved_mb": ledger.device_bytes / 2**20,
        "host_mb": ledger.host_bytes / 2**20,
        "step_s": statistics.median(times),
        "peak_mb": rss_mb(),
        "before_mb": before,
        "losses": losses,
    }


def _predicted_mb(case: str, seq: int, batch: int) -> float:
    import torch

    from meshforge.memory.estimate import measure_activations
    from meshforge.models.qwen3.model import Qwen3ForCausalLM

    estimate = measure_activations(
        lambda: Qwen3ForCausalLM(_args(seq)),
        _settings(case),
        micro_batch=batch,
        seq=seq,
        dtype=torch.float32,
        chunk_loss_size=CHUNK,
    )
    return estimate.device_bytes / 2**20


def _run_child(argv: list[str], threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", *argv, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(a: dict, b: dict, key: str) -> float | None:
    """``a[key] / b[key]``, or None when a case was not run (``--cases``)."""
    if key not in a or key not in b:
        return None
    return round(a[key] / b[key], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--child", nargs="*")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child is not None:
        if args.child[0] == "save":
            torch.save(_build_hf(int(args.child[2])).state_dict(), args.child[1])
            emit({})
            return
        case, seq, batch, steps, weights = args.child
        emit(_child(case, int(seq), int(batch), int(steps), weights))
        return
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "reference.pt")
        _run_child(["save", weights, str(args.seq)], args.threads)
        for case in args.cases.split(","):
            child = _run_child([case, str(args.seq), str(args.batch), str(args.steps), weights], args.threads)
            row: dict = {"case": case, "seq": args.seq, "batch": args.batch}
            row.update({k: round(v, 3) if isinstance(v, float) else v for k, v in child.items()})
            if not case.startswith("hf"):
                predicted = _predicted_mb(case, args.seq, args.batch)
                row["predicted_saved_mb"] = round(predicted, 1)
                row["predicted_over_measured"] = round(predicted / child["saved_mb"], 3)
            results[case] = child
            emit(row)
    none, full, hf_gc, hf = (results.get(k, {}) for k in ("none", "full", "hf_gc", "hf"))
    emit(
        {
            "ratios": True,
            "full_vs_none_saved": _ratio(full, none, "saved_mb"),
            "full_vs_none_step": _ratio(full, none, "step_s"),
            **{
                f"{name}_vs_none_saved": _ratio(results.get(name, {}), none, "saved_mb")
                for name in ("select_attention", "select_mlp", "swap")
            },
            "swap_vs_none_step": _ratio(results.get("swap", {}), none, "step_s"),
            "none_vs_hf_step": _ratio(none, hf, "step_s"),
            "full_vs_hf_gc_peak": _ratio(full, hf_gc, "peak_mb"),
            "full_vs_hf_gc_step": _ratio(full, hf_gc, "step_s"),
            "hf_gc_vs_hf_saved": _ratio(hf_gc, hf, "saved_mb"),
        }
    )


if __name__ == "__main__":
    main()
