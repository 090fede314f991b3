"""Step-3.5 trained by the real `Trainer` in dp2, tp2 (with sequence parallelism), pp2 and ep2
equals one process: the same losses and gradient norms over 2 steps.

The one-process run happens in the test process; one spawn of 2 gloo ranks then runs every layout
from `configs/step3p5/tiny.yaml` shrunk to 2 layers: a full-attention dense layer (half-rotary,
llama3-scaled RoPE) and a sliding-window sparse layer (8 heads, window 8 < sequence 32, routed
experts, shared expert, head-wise gates), so pp2 puts one kind on each stage and tp2 splits two
head layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed._layouts import assert_layouts_equal_one_process

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "step3p5" / "tiny.yaml"
SMALL = [
    "--train_dataset.dataloader.seq_length=32",
    "--training.local_batch_size=2",
    "--training.global_batch_size=4",
    "--model.num_hidden_layers=2",
    "--model.moe_layers_enum=1",
    "--model.hidden_size=64",
    "--model.intermediate_size=64",
    "--model.moe_intermediate_size=32",
    "--model.share_expert_dim=32",
    "--model.head_dim=16",
    "--model.sliding_window=8",
]
LAYOUTS: dict[str, list[str]] = {
    "dp2": [],
    "tp2 sp": ["--parallelism.tensor_parallel=2", "--parallelism.sequence_parallel=true"],
    "pp2": ["--parallelism.pipeline_parallel=2"],
    "ep2": ["--parallelism.expert_parallel=2"],
}
STEPS = 2


def test_step3p5_layouts_equal_one_process(tmp_path: Path) -> None:
    assert_layouts_equal_one_process(CONFIG, SMALL, LAYOUTS, tmp_path, steps=STEPS)
