"""Metric sinks: the run's `metrics.jsonl`, the console line, and TensorBoard.

`metrics.jsonl` holds one JSON object per optimizer step (1-based `step`, `loss`, `lr`,
`grad_norm`, `tokens`, `tokens_per_s`, `elapsed_s`, `memory_bytes`, plus any extra keys such as
auxiliary losses: `aux_loss`, `mtp_loss`). A skipped step (`meshforge.train.health`) has `skipped: true` and `skip_reason`,
and a non-finite loss or norm is written as null. On resume the file is kept and continues after the resumed step: records past
it are dropped, so the file always describes one consistent training history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from meshforge.monitor.stragglers import straggler_note


class JsonlMetrics:
    """Append-only per-step metrics file, truncated to `resume_step` on resume."""

    def __init__(self, path: Path, *, resume_step: int = 0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if path.exists():
            for line in path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if resume_step and int(record.get("step", 0)) <= resume_step:
                    kept.append(line)
        path.write_text("".join(f"{line}\n" for line in kept))
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardMetrics:
    """Scalars to TensorBoard every `log_interval` steps (`monitor.tensorboard`)."""

    def __init__(self, output_dir: Path, *, log_interval: int, queue_size: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir), max_queue=queue_size)
        self.log_interval = max(1, log_interval)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step % self.log_interval:
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, step)

    def write_expert_counts(self, lines: list[dict[str, Any]]) -> None:
        """`monitor.moe_monitor` lines as `moe/layer<l>/expert<e>` scalars (every monitored step)."""
        for line in lines:
            for expert, count in enumerate(line["counts"]):
                self.writer.add_scalar(f"moe/layer{line['layer']}/expert{expert}", count, int(line["step"]))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """The live progress line printed by rank 0."""
    width = len(str(total_steps))
    parts = [
        f"step {record['step']:>{width}}/{total_steps}",
        f"loss {_number(record['loss'], '.4f')}",
        f"lr {record['lr']:.3e}",
        f"grad_norm {_number(record['grad_norm'], '.3f')}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if record.get("skipped"):
        parts.insert(1, f"SKIPPED ({record.get('skip_reason', '')})")
    if "rewards/margins" in record:  # preference training (train/preference.py)
        parts.insert(
            2,
            f"rewards chosen {record['rewards/chosen']:.4f} rejected {record['rewards/rejected']:.4f} "
            f"margin {record['rewards/margins']:.4f} acc {record['rewards/accuracies']:.2f}"
            + (
                f" | logps chosen {record['logps/chosen']:.2f} rejected {record['logps/rejected']:.2f}"
                if "logps/chosen" in record  # dpo; a reward model (rm) has no log-probabilities
                else ""
            ),
        )
    if "tflops_per_rank" in record:
        parts.append(f"{record['tflops_per_rank']:.3g} TFLOP/s/rank")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if "memory_bytes" in record:
        parts.append(f"mem {record['memory_bytes'] / 2**30:.2f} GiB")
    straggler = straggler_note(record)
    if straggler is not None:
        parts.append(straggler)
    return " | ".join(parts)


def _number(value: float | None, spec: str) -> str:
    """A metric for the console; a skipped step's non-finite value is logged as null (`nan` here)."""
    return "nan" if value is None else format(value, spec)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
