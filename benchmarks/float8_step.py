"""bf16 against float8 (tensorwise, rowwise) and MXFP8 training steps of a ~1B Qwen3, through `meshforge train`.

    python benchmarks/float8_step.py                         # CUDA: bf16, tensorwise, rowwise (+ mxfp8 on sm100+)
    python benchmarks/float8_step.py --steps 100 --recipes bf16 rowwise
    python benchmarks/float8_step.py --cpu-smoke             # CPU: a tiny model, emulated, 3 steps

Each case is one `meshforge train` process with the same config (Qwen3, hidden 2048, 28 layers,
ffn 6144, 16 heads / 8 KV heads of 128, vocab 8192 from the bundled tokenizer, ~1.2 B parameters;
sequence 2048, batch 4; AdamW; `model.compute_dtype: bfloat16`, `kernels.compile: true`), except
`model.quant_recipe_name`. Each prints one JSON line: the median tokens/s and MFU (meshforge's
own `metrics.jsonl` fields, the warm-up and compile steps excluded), the last loss, and the
largest relative loss gap to the bf16 run over all steps. A recipe the GPU cannot run (float8
below sm89, MXFP8 below sm100) is reported as refused with meshforge's message.

Everything comes from this repository (model, tokenizer, a generated corpus): nothing is
downloaded.
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

from _harness import REPO, emit, write_corpus

CONFIG = """
training:
  steps: {steps}
  local_batch_size: {batch}
  global_batch_size: {batch}
  seed: 7
  log_interval: 1
optimizer:
  type: AdamW
  weight_decay: 0.1
lr_scheduler:
  type: ConstantWarmUpLR
  learning_rate: 3.e-4
  warmup_steps: 10
train_dataset:
  dataloader:
    type: TextDataLoader
    data_path: {data}
    seq_length: {seq}
    shuffle: true
model:
  model_type: qwen3
  tokenizer_name_or_path: meshforge://assets/tokenizer
  vocab_size: 8192
  hidden_size: {hidden}
  intermediate_size: {ffn}
  num_hidden_layers: {layers}
  num_attention_heads: {heads}
  num_key_value_heads: {kv}
  head_dim: {head_dim}
  compute_dtype: bfloat16
kernels:
  compile: {compile}
checkpoint:
  enable_save: false
"""

SHAPES = {
    "1b": {
        "hidden": 2048,
        "ffn": 6144,
        "layers": 28,
        "heads": 16,
        "kv": 8,
        "head_dim": 128,
        "seq": 2048,
        "batch": 4,
    },
    "tiny": {
        "hidden": 64,
        "ffn": 128,
        "layers": 2,
        "heads": 4,
        "kv": 2,
        "head_dim": 16,
        "seq": 32,
        "batch": 2,
    },
}


def _run(recipe: str, config: Path, out: Path) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "meshforge",
        "train",
        "--config",
        str(config),
        f"--training.output_dir={out}",
    ]
    if recipe != "bf16":
        cmd.append(f"--model.quant_recipe_name={recipe}")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        refused = next((line for line in tail if "quant_recipe_name" in line), None)
        return {"recipe": recipe, "refused" if refused else "failed": refused or "\n".join(tail)}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = records[len(records) // 5 + 2 :] or records[-1:]  # skip warm-up and compile steps
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "recipe": recipe,
        "steps": len(records),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "last_loss": records[-1]["loss"],
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--recipes", nargs="+", default=["bf16", "tensorwise", "rowwise", "mxfp8"])
    parser.add_argument("--no-compile", action="store_true", help="kernels.compile: false")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, 3 steps, emulated (CPU)")
    args = parser.parse_args()
    shape = SHAPES["tiny" if args.cpu_smoke else "1b"]
    steps = 3 if args.cpu_smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_corpus(
            root / "corpus.jsonl", 400 if args.cpu_smoke else 20_000, min_words=200, spread=300
        )
        config = root / "float8.yaml"
        compile_ = "false" if args.no_compile or args.cpu_smoke else "true"
        config.write_text(CONFIG.format(steps=steps, data=data, compile=compile_, **shape))
        results = [_run(recipe, config, root / recipe) for recipe in args.recipes]
    ref = next((r for r in results if r["recipe"] == "bf16" and "losses" in r), None)
    ref_losses = list(ref["losses"]) if ref is not None else []  # type: ignore[call-overload]
    ref_speed = ref.get("tokens_per_s") if ref is not None else None
    for result in results:
        losses = result.pop("losses", None)
        if ref_losses and isinstance(losses, list) and result["recipe"] != "bf16":
            result["max_rel_loss_gap_vs_bf16"] = max(
                abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=False)
            )
            if isinstance(ref_speed, float):
                result["speedup_vs_bf16"] = float(result["tokens_per_s"]) / ref_speed  # type: ignore[arg-type]
        emit(result)


if __name__ == "__main__":
    main()
