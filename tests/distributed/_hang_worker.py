"""A 2-rank training whose rank 1 sleeps inside the forward of step 3 (run under torchrun by test_watchdog.py).

Usage: torchrun --nproc-per-node 2 _hang_worker.py CONFIG OVERRIDE...
"""

from __future__ import annotations

import sys
import time

import torch

from meshforge.config import load_config
from meshforge.train.trainer import Trainer


class SleepingTrainer(Trainer):
    def forward_backward(self, batch: dict[str, torch.Tensor], normalizer: torch.Tensor) -> torch.Tensor:
        if self.step + 1 == 3 and self.run.env.dist.rank == 1:
            time.sleep(120)  # far past the test's step timeout
        return super().forward_backward(batch, normalizer)


if __name__ == "__main__":
    trainer = SleepingTrainer(load_config(sys.argv[1], sys.argv[2:]))
    trainer.setup()
    trainer.train()
