"""One torchft replica group of test_torchft.py: a `meshforge train` whose steps take at least PACE_S.

Usage: python _ft_worker.py PACE_S CONFIG OVERRIDE...   (or under torchrun for a several-rank group)

The pace keeps the survivor stepping while the killed group restarts. At the end each rank writes
`params-rank{R}.pt` (its local weights) into the run folder, for the comparison across groups.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from meshforge.config import load_config
from meshforge.train.replica_state import local_tensor
from meshforge.train.trainer import Trainer


class PacedTrainer(Trainer):
    pace_s = 0.0

    def train_step(self) -> dict[str, object]:
        start = time.perf_counter()
        record = super().train_step()
        time.sleep(max(0.0, self.pace_s - (time.perf_counter() - start)))
        return record


if __name__ == "__main__":
    PacedTrainer.pace_s = float(sys.argv[1])
    trainer = PacedTrainer(load_config(sys.argv[2], sys.argv[3:]))
    trainer.setup()
    trainer.train()
    rank = trainer.run.env.dist.rank
    params = {name: local_tensor(p).detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save(params, trainer.run.env.output_dir / f"params-rank{rank}.pt")
    sys.stdout.flush()
    # No interpreter finalization after gloo work (pytorch/pytorch#179291), as `python -m meshforge` does.
    os._exit(0)
