"""One prepared check of meshforge's CUDA paths: run it as is on any machine with one GPU.

    scripts/gpu_check.sh                  # CUDA: every family's tiny config and a ~1B Qwen3, ~9 min on an H200
    scripts/gpu_check.sh --cpu-smoke      # the same cases, tiny and short, on the CPU (CI runs this)
    scripts/gpu_check.sh --only llama,1b  # a subset (case names as printed)

Each case is a real `meshforge train` (or `generate`) run in a fresh process, read back from its
metrics.jsonl: tokens/s, MFU (on CUDA, from the run's own log), the device's peak allocated
memory against `config validate`'s predicted peak, and the case's own check:

- `<family>`: 20 bf16 steps of `configs/<family>/tiny.yaml` with `kernels.compile: auto` and the
  fused loss where the family has it;
- `1b`: a Qwen3 of about 1B parameters (hidden 2048, 16 layers), 20 bf16 steps;
- `first-loss`: the llama tiny config's first loss in bf16 here against fp32 on the CPU (same
  seed, same weights): the relative difference;
- `swap`: activation swap of layers 0-2 (its CUDA side stream), losses against no swap;
- `async-save`: an asynchronous checkpoint (pinned host staging) at step 2 of 4, then resumed;
- `float8-rowwise`, `float8-tensorwise`: torchao float8 linears (CUDA with sm 8.9 or newer);
- `generate`: greedy generation with the KV cache from the llama run's checkpoint.

Prints one table and writes it to `--output` (default `output/gpu_check/table.md`). Exit status:
0 when every case that could run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "mamba3", "minimax_m2", "qwen3_next", "step3p5")
ONE_B = [
    "--model.hidden_size=2048",
    "--model.intermediate_size=6144",
    "--model.num_hidden_layers=16",
    "--model.num_attention_heads=16",
    "--model.num_key_value_heads=8",
    "--model.head_dim=128",
    "--train_dataset.dataloader.seq_length=2048",
    "--training.local_batch_size=4",
]


@dataclass
class Result:
    case: str
    status: str = "ok"
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    predicted_gib: float | None = None
    note: str = ""
    seconds: float = 0.0


@dataclass
class Check:
    device: str
    smoke: bool
    out: Path
    results: list[Result] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return 2 if self.smoke else 20

    def common(self, name: str) -> list[str]:
        dtype = "float32" if self.device == "cpu" else "bfloat16"
        return [
            f"--context.device_target={self.device}",
            f"--model.compute_dtype={dtype}",
            f"--training.output_dir={self.out / name}",
            "--training.overwrite_output_dir=true",
            "--training.log_interval=1",
            "--kernels.compile=auto",
        ]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "meshforge", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(folder: Path) -> list[dict[str, object]]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _last(records: list[dict[str, object]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return float(values[-1]) if values else None  # type: ignore[arg-type]


def _predicted_peak(config: str, overrides: list[str]) -> float | None:
    proc = _run(["config", "validate", config, "--world-size", "1", "--no-path-checks", *overrides], 300)
    found = re.search(r"predicted peak per rank .*= ([0-9.]+) GiB", proc.stdout)
    return float(found.group(1)) if found else None


def _fail_note(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return lines[-1][:160] if lines else f"exit {proc.returncode}"


def train_case(check: Check, name: str, config: str, extra: list[str], *, steps: int | None = None) -> Result:
    """One training run; its metrics read back."""
    result = Result(name)
    overrides = [f"--training.steps={steps or check.steps}", *check.common(name), *extra]
    started = time.perf_counter()
    proc = _run(["train", "--config", config, *overrides], 900)
    result.seconds = time.perf_counter() - started
    if proc.returncode != 0:
        result.status, result.note = "FAILED", _fail_note(proc)
        return result
    records = _records(check.out / name)
    result.tokens_per_s = _last(records, "tokens_per_s")
    result.mfu = _last(records, "mfu")
    peak = _last(records, "device_memory_peak_bytes")
    result.peak_gib = peak / 2**30 if peak is not None else None
    result.predicted_gib = _predicted_peak(config, overrides)
    loss = _last(records, "loss")
    result.note = f"last loss {loss:.4f}" if loss is not None else "no loss logged"
    return result


def first_loss_case(check: Check) -> Result:
    """The first loss on this device against fp32 on the CPU (the same seed and data)."""
    config = "configs/llama/tiny.yaml"
    here = train_case(check, "first-loss", config, [], steps=1)
    if here.status != "ok":
        return here
    cpu = _run(
        ["train", "--config", config, "--training.steps=1", "--context.device_target=cpu", "--model.compute_dtype=float32",
         f"--training.output_dir={check.out / 'first-loss-cpu'}", "--training.overwrite_output_dir=true",
         "--kernels.compile=false"],
        600,
    )  # fmt: skip
    if cpu.returncode != 0:
        return Result("first-loss", "FAILED", note="cpu run: " + _fail_note(cpu))
    ours = _last(_records(check.out / "first-loss"), "loss")
    ref = _last(_records(check.out / "first-loss-cpu"), "loss")
    if ours is None or ref is None:
        return Result("first-loss", "FAILED", note="no loss logged")
    diff = abs(ours - ref) / abs(ref)
    here.status = "ok" if diff < 2e-2 else "FAILED"
    here.note = f"{check.device} {ours:.5f} vs cpu fp32 {ref:.5f}: relative {diff:.1e} (bound 2e-2)"
    return here


def swap_case(check: Check) -> Result:
    config = "configs/llama/tiny.yaml"
    plain = train_case(check, "swap-off", config, ["--kernels.compile=false"], steps=3)
    swapped = train_case(
        check, "swap", config, ["--kernels.compile=false", "--swap.enable=true", "--swap.layer_swap=[{layers: ['0-2']}]"],
        steps=3,
    )  # fmt: skip
    if plain.status != "ok" or swapped.status != "ok":
        return swapped if swapped.status != "ok" else plain
    a = [r.get("loss") for r in _records(check.out / "swap-off")]
    b = [r.get("loss") for r in _records(check.out / "swap")]
    moved = _last(_records(check.out / "swap"), "swap_bytes")
    swapped.status = "ok" if a == b and moved else "FAILED"
    swapped.note = (
        f"losses {'equal' if a == b else 'DIFFER'} to no swap; {moved or 0:.0f} bytes to host per step"
    )
    return swapped


def async_save_case(check: Check) -> Result:
    config = "configs/llama/tiny.yaml"
    extra = [
        "--checkpoint.async_save=true",
        "--checkpoint.save_interleaved_steps=2",
        "--kernels.compile=false",
    ]
    first = train_case(check, "async-save", config, extra, steps=4)
    if first.status != "ok":
        return first
    resumed = _run(
        ["train", "--config", config, "--training.steps=5", *check.common("async-save"), *extra,
         "--training.overwrite_output_dir=false", "--checkpoint.load_path=auto"],
        600,
    )  # fmt: skip
    if resumed.returncode != 0:
        return Result("async-save", "FAILED", note="resume: " + _fail_note(resumed))
    steps = [r.get("step") for r in _records(check.out / "async-save")]
    first.note = f"saved at 2 and 4 while training; resumed to step {steps[-1] if steps else '?'}"
    return first


def float8_case(check: Check, recipe: str) -> Result:
    name = f"float8-{recipe}"
    if check.device == "cpu":
        return Result(name, "skipped", note="needs CUDA (sm 8.9+)")
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        return Result(name, "skipped", note=f"compute capability {torch.cuda.get_device_capability()} < 8.9")
    return train_case(check, name, "configs/llama/tiny.yaml", [f"--model.quant_recipe_name={recipe}"])


def generate_case(check: Check) -> Result:
    result = Result("generate")
    checkpoints = check.out / "async-save" / "checkpoints"
    if not checkpoints.exists():
        return Result("generate", "skipped", note="no checkpoint (async-save did not run)")
    started = time.perf_counter()
    proc = _run(
        ["generate", "-c", "configs/llama/tiny.yaml", f"--checkpoint.load_path={checkpoints}",
         f"--context.device_target={check.device}", "--prompt", "def add(a, b):", "--max-new-tokens", "32",
         "--greedy"],
        600,
    )  # fmt: skip
    result.seconds = time.perf_counter() - started
    if proc.returncode != 0:
        return Result("generate", "FAILED", note=_fail_note(proc), seconds=result.seconds)
    result.note = f"{len(proc.stdout.split())} words generated with the KV cache"
    return result


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def table(results: list[Result], device: str) -> str:
    head = f"meshforge gpu_check on {device}\n\n"
    rows = [
        "| case | status | tokens/s | MFU | peak GiB | predicted GiB | seconds | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        mfu = _fmt(100 * r.mfu, ".1f") + "%" if r.mfu is not None else "-"
        rows.append(
            f"| {r.case} | {r.status} | {_fmt(r.tokens_per_s, ',.0f')} | {mfu} | {_fmt(r.peak_gib, '.2f')} | "
            f"{_fmt(r.predicted_gib, '.2f')} | {r.seconds:.0f} | {r.note} |"
        )
    return head + "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny and short, on the CPU")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--output", default=None, help="the table's file (default output/gpu_check/table.md)")
    args = parser.parse_args()
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --cpu-smoke for the CPU version", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    title = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    out = ROOT / "output" / "gpu_check"
    check = Check(device, args.cpu_smoke, out)
    families = ("llama", "qwen3_moe") if args.cpu_smoke else FAMILIES
    cases: dict[str, object] = {
        f: (lambda f=f: train_case(check, f, f"configs/{f}/tiny.yaml", [])) for f in families
    }
    if not args.cpu_smoke:
        cases["1b"] = lambda: train_case(check, "1b", "configs/demo.yaml", ONE_B)
    cases.update(
        {
            "first-loss": lambda: first_loss_case(check),
            "swap": lambda: swap_case(check),
            "async-save": lambda: async_save_case(check),
            "float8-rowwise": lambda: float8_case(check, "rowwise"),
            "float8-tensorwise": lambda: float8_case(check, "tensorwise"),
            "generate": lambda: generate_case(check),
        }
    )
    wanted = set(args.only.split(",")) if args.only else set(cases)
    unknown = wanted - set(cases)
    if unknown:
        print(f"error: unknown case(s) {sorted(unknown)}; valid: {', '.join(cases)}", file=sys.stderr)
        return 2
    for name, run in cases.items():
        if name in wanted:
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            check.results.append(run())  # type: ignore[operator]
    text = table(check.results, title)
    print(text)
    target = Path(args.output) if args.output else out / "table.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target}", file=sys.stderr)
    return 0 if all(r.status in ("ok", "skipped") for r in check.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
