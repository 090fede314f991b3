"""MiniMax-M2 trained by the real `Trainer` in dp2, tp2 (with sequence parallelism), pp2, ep2 and
cp2 (Ulysses) equals one process: the same losses and gradient norms over 2 steps.

The one-process run happens in the test process; one spawn of 2 gloo ranks then runs every layout
from `configs/minimax_m2/tiny.yaml` shrunk to 2 layers (every layer sparse, half-rotary heads, the
router aux loss on). Under tp2 the whole-width q/k norms sum their squares over the TP ranks, so a
wrong reduction shows in the first loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed._layouts import assert_layouts_equal_one_process

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "minimax_m2" / "tiny.yaml"
SMALL = [
    "--train_dataset.dataloader.seq_length=32",
    "--training.local_batch_size=2",
    "--training.global_batch_size=4",
    "--model.num_hidden_layers=2",
    "--model.hidden_size=64",
    "--model.intermediate_size=32",
    "--model.head_dim=16",
    "--model.rotary_dim=8",
    "--model.num_local_experts=4",
]
LAYOUTS: dict[str, list[str]] = {
    "dp2": [],
    "tp2 sp": ["--parallelism.tensor_parallel=2", "--parallelism.sequence_parallel=true"],
    "pp2": ["--parallelism.pipeline_parallel=2"],
    "ep2": ["--parallelism.expert_parallel=2"],
    "cp2 ulysses": ["--parallelism.context_parallel=2", "--parallelism.context_parallel_method=ulysses"],
}
STEPS = 2


def test_minimax_m2_layouts_equal_one_process(tmp_path: Path) -> None:
    assert_layouts_equal_one_process(CONFIG, SMALL, LAYOUTS, tmp_path, steps=STEPS)
