"""One torchft replica group of test_torchft.py: a `meshforge train` whose lone steps take PACE_S.

Usage: python _ft_worker.py PACE_S GO_FILE CONFIG OVERRIDE...   (one process per rank of the group)

With a GO_FILE other than `-`, the process imports everything and then waits for that file
before it builds the run: a stand-by that replaces a killed group without paying the start-up.
A step that ran without every group (the survivor's, while its peer restarts) takes at least
PACE_S, so that the survivor is still stepping when the peer comes back; the others run at full
speed. Group 0's loss of step 2 is NaN once (a transient fault). At the end each rank writes `params-rank{R}.pt` (its local weights) into the run folder.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from meshforge.config import load_config
from meshforge.train.replica_state import local_tensor
from meshforge.train.run import TrainSummary
from meshforge.train.trainer import Trainer


class PacedTrainer(Trainer):
    pace_s = 0.0
    # Replica group 0's loss of this step is NaN on its first computation only: a transient fault
    # that `training.rerun_mode` must recompute on every group together.
    poison_step = 2
    _poisoned = False

    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        loss = super().forward_backward(batch, normalizer)
        replicas = self.run.replicas
        if self.step + 1 == self.poison_step and replicas is not None and replicas.replica_id == 0:
            if not self._poisoned:
                self._poisoned = True
                return loss * float("nan")
        return loss

    def train_step(self) -> dict[str, object]:
        start = time.perf_counter()
        record = super().train_step()
        if record["replicas"] < self.cfg.parallelism.fault_tolerance.replica_groups:
            time.sleep(max(0.0, self.pace_s - (time.perf_counter() - start)))
        return record

    def train(self) -> TrainSummary:
        summary = super().train()
        params = {name: local_tensor(p).detach().clone() for name, p in self.model.named_parameters()}
        torch.save(params, self.run.env.output_dir / f"params-rank{self.run.env.dist.rank}.pt")
        return summary


if __name__ == "__main__":
    PacedTrainer.pace_s = float(sys.argv[1])
    go = Path(sys.argv[2])
    while sys.argv[2] != "-" and not go.exists():
        time.sleep(0.02)
    trainer = PacedTrainer(load_config(sys.argv[3], sys.argv[4:]))
    trainer.setup()
    trainer.train()
    sys.stdout.flush()
    # No interpreter finalization after gloo work (pytorch/pytorch#179291), as `python -m meshforge` does.
    os._exit(0)
