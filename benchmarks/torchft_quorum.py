"""What torchft replica groups cost per step: the quorum, the managed all-reduces and the commit vote.

Two cases train the same tiny Qwen3 with the same per-process work, both cores busy in each:
* ``alone``: two independent one-process `meshforge train` runs (no torchft), each over a batch
  of `local_batch_size` rows per step;
* ``torchft``: two one-process replica groups (`parallelism.fault_tolerance`, a lighthouse in
  this process) over a global batch of both groups' rows, so each process computes the same
  rows per step and adds the quorum, the cross-group token count, the gradient and loss sums and
  `should_commit`.

Each process times its own steps (`train_step`, in-process, after `--warmup` steps) and, under
torchft, the four replica operations. ``ratio`` is the median step time with torchft over the
median without; the cases alternate `--repeats` times so that load on a shared machine falls on
both. Prints one JSON line per case and one summary line.

Run: ``python benchmarks/torchft_quorum.py [--steps 40] [--repeats 2] [--hidden 64]``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import cpu_name, emit, utc_now, write_corpus

CONFIG = """
training: {{steps: {steps}, local_batch_size: 2, global_batch_size: {global_batch}, seed: 7, log_interval: 1000}}
optimizer: {{type: AdamW, weight_decay: 0.1}}
lr_scheduler: {{type: ConstantWarmUpLR, learning_rate: 3.e-3, warmup_steps: 2}}
checkpoint: {{enable_save: false}}
monitor: {{plot_curves: false}}
train_dataset:
  dataloader: {{type: TextDataLoader, data_path: {data}, seq_length: 32, shuffle: true}}
model:
  model_type: qwen3
  tokenizer_name_or_path: meshforge://assets/tokenizer
  vocab_size: 8192
  hidden_size: {hidden}
  intermediate_size: {intermediate}
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 16
  tie_word_embeddings: true
"""

REPLICA_OPS = ("start_step", "sum_tokens", "reduce_step", "should_commit")


def child(out: Path, config: str, overrides: list[str]) -> None:
    """One process of a case: train, timing each step and (under torchft) each replica operation."""
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    step_s: list[float] = []
    ops: dict[str, list[float]] = {name: [] for name in REPLICA_OPS}

    class TimedTrainer(Trainer):
        def train_step(self) -> dict[str, Any]:
            start = time.perf_counter()
            record = super().train_step()
            step_s.append(time.perf_counter() - start)
            return record

    trainer = TimedTrainer(load_config(config, overrides))
    trainer.setup()
    replicas = trainer.run.replicas
    if replicas is not None:
        for name in REPLICA_OPS:
            setattr(replicas, name, _timed(getattr(replicas, name), ops[name]))
    trainer.train()
    out.write_text(json.dumps({"step_s": step_s, "ops": ops}))
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization after gloo work, as `python -m meshforge` does


def _timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    return wrapper


def run_case(name: str, work: Path, config: Path, lighthouse: str | None, warmup: int) -> dict[str, Any]:
    """Both processes of a case at once; their timings after the warm-up steps, pooled."""
    procs, outs = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
    for group in range(2):
        out = work / f"{name}-{group}.json"
        overrides = [
            f"--training.output_dir={work / f'{name}-{group}'}",
            "--training.overwrite_output_dir=true",
        ]
        if lighthouse is not None:
            overrides += [
                "--parallelism.fault_tolerance.enable=true",
                f"--parallelism.fault_tolerance.replica_id={group}",
                f"--parallelism.fault_tolerance.lighthouse={lighthouse}",
            ]
        cmd = [sys.executable, __file__, "--child", str(out), str(config), *overrides]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
        outs.append(out)
    for proc in procs:
        log, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{name}: a process failed ({proc.returncode}):\n{log.decode()[-3000:]}")
    runs = [json.loads(out.read_text()) for out in outs]
    steps = [s for run in runs for s in run["step_s"][warmup:]]
    ops = {op: [s for run in runs for s in run["ops"][op][warmup:]] for op in REPLICA_OPS}
    return {"step_s": steps, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (64: the tests' tiny model)")
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )
    pooled: dict[str, dict[str, list[float]]] = {
        "alone": {"step_s": []},
        "torchft": {"step_s": [], **{op: [] for op in REPLICA_OPS}},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_corpus(work / "corpus.jsonl", num_docs=2000)
        configs = {}
        for name, global_batch in (("alone", 2), ("torchft", 4)):
            configs[name] = work / f"{name}.yaml"
            configs[name].write_text(
                CONFIG.format(
                    steps=args.steps,
                    global_batch=global_batch,
                    data=data,
                    hidden=args.hidden,
                    intermediate=2 * args.hidden,
                )
            )
        for _ in range(args.repeats):
            for name in ("alone", "torchft"):
                address = lighthouse.address() if name == "torchft" else None
                result = run_case(name, work, configs[name], address, args.warmup)
                pooled[name]["step_s"] += result["step_s"]
                for op in REPLICA_OPS if name == "torchft" else ():
                    pooled[name][op] += result["ops"][op]
    lighthouse.shutdown()
    medians = {name: statistics.median(case["step_s"]) for name, case in pooled.items()}
    for name, case in pooled.items():
        emit(
            {
                "case": name,
                "step_ms": round(1e3 * medians[name], 2),
                **{
                    f"{op}_ms": round(1e3 * statistics.median(case[op]), 2)
                    for op in REPLICA_OPS
                    if op in case
                },
                "steps_timed": len(case["step_s"]),
            }
        )
    emit(
        {
            "benchmark": "torchft_quorum",
            "hidden": args.hidden,
            "ratio": round(medians["torchft"] / medians["alone"], 3),
            "added_ms_per_step": round(1e3 * (medians["torchft"] - medians["alone"]), 2),
            "cpu": cpu_name(),
            "when": utc_now(),
        }
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
