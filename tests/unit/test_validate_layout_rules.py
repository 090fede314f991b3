"""`config validate --world-size N` meets the model's divisibility rules of the layout, as `train` does.

A TP degree that does not divide the heads used to pass validation (with a memory plan) and then
stop torchrun with a traceback; the family's own TP plan now names the key at validation.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO, meshforge_here

DEMO = str(REPO / "configs" / "demo.yaml")


def test_tp_that_does_not_divide_the_heads_is_refused_at_the_world_size(tmp_path: Path) -> None:
    args = ["config", "validate", DEMO, "--world-size", "6", "--parallelism.tensor_parallel", "3"]
    proc = meshforge_here(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "error: model.num_attention_heads: 4 is not divisible by parallelism.tensor_parallel (3)"
        in proc.stderr
    )
    assert "valid" not in proc.stdout
    fits = meshforge_here(
        "config", "validate", DEMO, "--world-size", "4", "--parallelism.tensor_parallel", "2", cwd=tmp_path
    )
    assert fits.returncode == 0 and "valid for world size 4" in fits.stdout
