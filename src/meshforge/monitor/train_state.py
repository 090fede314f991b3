"""`monitor.train_state`: per-parameter gradient norms and each rank's loss and norm, on log steps.

Keys in `metrics.jsonl` (and TensorBoard, as `train/<key>`):
- `local_norm/<parameter>` (`local_norm: true`, a pattern or a list of patterns, shell-style on the
  parameter name, e.g. `"*embed_tokens*"`): the pre-clip norm of that parameter's whole gradient,
  its shards combined (a replicated copy counted once).
- `device_norm/rank<r>` (`device_norm: true`): the pre-clip norm of every gradient rank r holds
  (its shards; under pipeline parallelism its stage).
- `local_loss/rank<r>` (`local_loss: true`): rank r's own mean cross-entropy (its loss sum over its
  own valid tokens).
- `device_loss/rank<r>` (`device_loss: true`): rank r's share of the step's loss (its loss sum over
  the normaliser); the data ranks' shares add up to `loss`.

Everything is measured after the backward and before clipping, only on log steps (the console's:
every `training.log_interval`-th step, the first and the last), and travels in one all-reduce.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn

    from meshforge.monitor.config import TrainStateConfig

KEY = "monitor.train_state"


def is_log_step(step: int, interval: int, total: int) -> bool:
    """The steps the console prints a line for (and the monitors measure)."""
    return step % max(1, interval) == 0 or step in (1, total)


def _patterns(value: bool | str | list[str]) -> list[str]:
    if value is True:
        return ["*"]
    if value is False or value == "":
        return []
    return [value] if isinstance(value, str) else list(value)


@dataclass
class TrainStateMonitor:
    """The switched-on parts of `monitor.train_state` for one rank.

    Args:
        names: the parameters whose norms are logged, the same list on every rank (under
            pipeline parallelism a rank holds only some of them).
        device_norm, local_loss, device_loss: the per-rank switches.
        rank, world: this process in the default group.
        ranks_per_stage: world / pipeline degree, the ranks that hold one stage's parameters.
    """

    names: list[str]
    device_norm: bool
    local_loss: bool
    device_loss: bool
    rank: int
    world: int
    ranks_per_stage: int
    device: torch.device

    @classmethod
    def build(
        cls,
        cfg: TrainStateConfig,
        model: nn.Module,
        *,
        rank: int,
        world: int,
        pp: int,
        device: torch.device,
        skip: Sequence[str] = (),
    ) -> TrainStateMonitor | None:
        """None when every part is off. Collective (one object gather) when `local_norm` is on.

        `skip`: parameter names that are copies of another (a tied head on the last stage).
        Raises ValueError naming `monitor.train_state.local_norm` when a pattern matches nothing.
        """
        patterns = _patterns(cfg.local_norm)
        if not (patterns or cfg.device_norm or cfg.local_loss or cfg.device_loss):
            return None
        names: list[str] = []
        if patterns:
            local = [n for n, _ in model.named_parameters() if n not in skip]
            every = [local]
            if dist.is_initialized() and world > 1:
                gathered: list[list[str] | None] = [None] * world
                dist.all_gather_object(gathered, local)
                every = [g for g in gathered if g is not None]
            known = sorted({n for names_of_rank in every for n in names_of_rank})
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in known):
                    example = known[0] if known else "none"
                    raise ValueError(
                        f"{KEY}.local_norm: pattern {pattern!r} matches no parameter (names look like "
                        f"{example!r}; use shell-style wildcards such as '*embed_tokens*')"
                    )
            names = [n for n in known if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        return cls(
            names=names,
            device_norm=cfg.device_norm,
            local_loss=cfg.local_loss,
            device_loss=cfg.device_loss,
            rank=rank,
            world=world,
            ranks_per_stage=max(1, world // max(1, pp)),
            device=device,
        )

    def collect(
        self, model: nn.Module, *, loss_sum: float, local_tokens: int, normalizer: float
    ) -> dict[str, float]:
        """This step's values on every rank (one all-reduce); call on log steps on every rank."""
        n, w = len(self.names), self.world
        values = torch.zeros(n + 3 * w, dtype=torch.float64)
        params = dict(model.named_parameters())
        device_sq = 0.0
        for i, name in enumerate(self.names):
            param = params.get(name)
            if param is None or param.grad is None:
                continue
            values[i] = _local_sq(param.grad) / self._copies(param)
        if self.device_norm:
            device_sq = sum(_local_sq(p.grad) for p in params.values() if p.grad is not None)
        values[n + self.rank] = device_sq
        values[n + w + self.rank] = loss_sum / max(local_tokens, 1)
        values[n + 2 * w + self.rank] = loss_sum / normalizer
        out = values.to(self.device)
        if dist.is_initialized() and w > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        total = out.cpu().tolist()
        record: dict[str, float] = {
            f"local_norm/{name}": math.sqrt(total[i]) for i, name in enumerate(self.names)
        }
        for r in range(w):
            if self.device_norm:
                record[f"device_norm/rank{r}"] = math.sqrt(total[n + r])
            if self.local_loss:
                record[f"local_loss/rank{r}"] = total[n + w + r]
            if self.device_loss:
                record[f"device_loss/rank{r}"] = total[n + 2 * w + r]
        return record

    def _copies(self, param: torch.Tensor) -> int:
        """How many ranks of the world hold the same values of this parameter's gradient."""
        mesh = getattr(param, "device_mesh", None)
        placements = getattr(param, "placements", None)
        if mesh is None or placements is None:
            return self.ranks_per_stage
        replicated = 1
        for dim, placement in enumerate(placements):
            if placement.is_replicate():
                replicated *= mesh.size(dim)
        return replicated * max(1, self.ranks_per_stage // mesh.size())


def _local_sq(grad: torch.Tensor) -> float:
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return float(local.detach().to(torch.float64).pow(2).sum())
