"""`{output_dir}/trainer_log.jsonl`: LLaMA-Factory's per-step record (`monitor.trainer_log`).

LLaMA-Factory's `LogCallback` writes one JSON line per logged step with `current_steps`,
`total_steps`, `loss`, `lr`, `epoch`, `percentage`, `elapsed_time` and `remaining_time` (its
web UI and scripts read the file); keys it has no value for are left out, as it does. The same
record is written here from meshforge's step record, beside `metrics.jsonl`, on the steps the
console logs (`training.log_interval`, and the last one), with `eval_loss` on evaluation steps.
The times are `H:MM:SS`, the remaining time extrapolated from the mean step time of this run.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

FILE = "trainer_log.jsonl"


class TrainerLog:
    """Append-only `trainer_log.jsonl`, cut back to `start_step` on resume (as metrics.jsonl)."""

    def __init__(
        self,
        output_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        log_interval: int,
        steps_per_epoch: float | None,
    ) -> None:
        self.path = output_dir / FILE
        self.total_steps = total_steps
        self.start_step = start_step
        self.log_interval = max(1, log_interval)
        self.steps_per_epoch = steps_per_epoch
        kept: list[str] = []
        if self.path.exists() and start_step:
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if int(json.loads(line).get("current_steps", 0)) <= start_step:
                        kept.append(line)
                except (ValueError, AttributeError):
                    continue
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")

    def line(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """The LLaMA-Factory record of one step record, or None on a step it does not log."""
        step = int(record["step"])
        evaluated = "eval_loss" in record
        if step % self.log_interval and step != self.total_steps and not evaluated:
            return None
        elapsed = float(record.get("elapsed_s", 0.0))
        done = step - self.start_step
        remaining = (self.total_steps - step) * elapsed / done if done > 0 else 0.0
        out: dict[str, Any] = {"current_steps": step, "total_steps": self.total_steps}
        for key, name in (("loss", "loss"), ("eval_loss", "eval_loss"), ("lr", "lr")):
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                out[name] = round(float(value), 4) if name != "lr" else float(value)
        if self.steps_per_epoch:
            out["epoch"] = round(step / self.steps_per_epoch, 2)
        out["percentage"] = round(step / self.total_steps * 100, 2) if self.total_steps else 100
        out["elapsed_time"] = str(timedelta(seconds=int(elapsed)))
        out["remaining_time"] = str(timedelta(seconds=int(remaining)))
        if record.get("tokens_seen") and elapsed > 0:
            out["throughput"] = round(float(record["tokens_seen"]) / elapsed, 2)
            out["total_tokens"] = int(record["tokens_seen"])
        return out

    def write(self, record: dict[str, Any]) -> None:
        line = self.line(record)
        if line is not None:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()
