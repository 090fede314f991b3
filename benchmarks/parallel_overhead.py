"""Parallel overhead on CPU: tokens/s and collective volume per layout, same global batch.

Each layout trains the same model on the same data with the same global batch through
`meshforge train` (torchrun for 2 processes), with `MESHFORGE_COMM_STATS=1` so that every
step's collectives are counted where they are issued (see `meshforge.utils.comms`). The
single process is the reference: it gets all the cores as threads (OMP_NUM_THREADS = cores),
each of N processes gets cores / N threads, so every layout uses the same machine.

Reported per layout (median over the timed steps, the first `--warmup` steps dropped):
* ``step_s``: wall time of one optimizer step; ``per_token_vs_1``: per-token step time over
  the 1-process run's (target for dp2: <= 1.3);
* ``tokens_per_s`` (whole job) and ``tokens_per_s_per_process``;
* ``comm_mb_per_step``: collective buffer bytes of rank 0 per step, and ``comm_calls``.

Run: ``python benchmarks/parallel_overhead.py [--layouts 1,dp2,tp2,pp2] [--steps 8] [--quick]``;
MoE: ``--moe --top-k 4 --layouts 1,dp2,ep2,ep2_dedup`` (qwen3_moe, 8 experts).
Prints one JSON line per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import emit, write_corpus

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["--parallelism.tensor_parallel=2"]),
    "pp2": (2, ["--parallelism.pipeline_parallel=2"]),
    "cp2": (2, ["--parallelism.context_parallel=2", "--parallelism.context_parallel_method=ulysses"]),
    "hsdp2": (2, ["--parallelism.data_parallel_shard=1"]),
    # MoE (--moe): experts over 2 ranks, plain and de-duplicated token dispatch.
    "ep2": (2, ["--parallelism.expert_parallel=2"]),
    "ep2_dedup": (
        2,
        [
            "--parallelism.expert_parallel=2",
            "--parallelism.moe_token_dispatcher_type=alltoall_deredundancy",
            "--parallelism.npu_nums_per_device=2",
        ],
    ),
}

CONFIG = """
training:
  steps: {steps}
  local_batch_size: {local}
  global_batch_size: {global_batch}
  seed: 7
  log_interval: 1
optimizer: {{type: AdamW, weight_decay: 0.1}}
lr_scheduler: {{type: ConstantWarmUpLR, learning_rate: 1.e-3, warmup_steps: 2}}
checkpoint: {{enable_save: false}}
train_dataset:
  dataloader: {{type: TextDataLoader, data_path: {data}, seq_length: {seq}, shuffle: true}}
model:
  model_type: {model_type}
  tokenizer_name_or_path: meshforge://assets/tokenizer
  vocab_size: 8192
  hidden_size: {hidden}
  intermediate_size: {intermediate}
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: {head_dim}
  tie_word_embeddings: false
{moe}"""

MOE = """  num_experts: 8
  num_experts_per_tok: {top_k}
  moe_intermediate_size: {moe_width}
  output_router_logits: true
  router_aux_loss_coef: 0.01
"""


def run_layout(name: str, config: Path, work: Path, cores: int, global_batch: int) -> dict:
    nproc, overrides = LAYOUTS[name]
    out = work / name
    # pp needs the micro-batches of one step to go through the pipeline: local batch = global / dp.
    env = dict(os.environ, OMP_NUM_THREADS=str(max(cores // nproc, 1)), MESHFORGE_COMM_STATS="1")
    base = [sys.executable, "-m"]
    if nproc > 1:
        base += ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    cmd = [*base, "meshforge", "train", "--config", str(config), f"--training.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"layout": name, "error": " | ".join(tail)}
    return {
        "layout": name,
        "records": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
    }


def summarise(result: dict, warmup: int, nproc: int) -> dict:
    records = result["records"][warmup:]
    step_s = statistics.median(r["tokens"] / r["tokens_per_s"] for r in records)
    tokens = records[0]["tokens"]
    return {
        "layout": result["layout"],
        "processes": nproc,
        "step_s": round(step_s, 4),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "tokens_per_s_per_process": round(tokens / step_s / nproc, 1),
        "comm_mb_per_step": round(statistics.median(r["comm_bytes"] for r in records) / 1e6, 3),
        "comm_calls": int(statistics.median(r["comm_calls"] for r in records)),
        "final_loss": round(result["records"][-1]["loss"], 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="1,dp2,tp2,pp2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model, 5 steps: a smoke run")
    parser.add_argument("--moe", action="store_true", help="qwen3_moe with 8 experts (for ep2, ep2_dedup)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token with --moe")
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    steps, warmup = (5, 2) if args.quick else (args.steps, args.warmup)
    hidden, seq = (64, 64) if args.quick else (256, 256)
    global_batch = 8
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_corpus(work / "corpus.jsonl", num_docs=2000)
        reference = None
        for name in args.layouts.split(","):
            nproc = LAYOUTS[name][0]
            # Same global batch everywhere; pp keeps all of it on each pipeline (dp 1).
            dp = 1 if name in ("pp2", "tp2", "cp2") else nproc
            config = work / f"{name}.yaml"
            config.write_text(
                CONFIG.format(
                    steps=steps,
                    local=global_batch // dp // (4 if name == "pp2" else 1),
                    global_batch=global_batch,
                    data=data,
                    seq=seq,
                    hidden=hidden,
                    intermediate=hidden * 3,
                    head_dim=hidden // 8,
                    model_type="qwen3_moe" if args.moe else "qwen3",
                    moe=MOE.format(top_k=args.top_k, moe_width=hidden) if args.moe else "",
                )
            )
            result = run_layout(name, config, work, cores, global_batch)
            if "error" in result:
                emit(result)
                continue
            row = summarise(result, warmup, nproc)
            if reference is None and name == "1":
                reference = row
            if reference is not None:
                row["per_token_vs_1"] = round(
                    (row["step_s"] / row["tokens_per_step"])
                    / (reference["step_s"] / reference["tokens_per_step"]),
                    3,
                )
            emit(row)


if __name__ == "__main__":
    main()
