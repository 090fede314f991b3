"""The precomputed reference table on 2 ranks equals a reference forward in one process.

Full fine-tuning: the table pass deals the rows over the data-parallel ranks (dp2: FSDP over both)
and all-reduces the table; under tp2 both ranks compute every row. Each step's loss, gradient norm
and preference metrics must equal the one-process run that runs the frozen copy every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed.test_dpo_layouts import ABS, LAYOUTS, METRICS
from tests.unit.test_dpo_train import CONFIG, FULL, TINY

pytestmark = pytest.mark.slow
# The layouts the table pass supports (CP and PP with precompute are refused by name).
TABLE_LAYOUTS = {key: LAYOUTS[key] for key in ("dp2", "tp2")}


def test_precompute_on_dp2_and_tp2_equals_the_reference_forward(tmp_path: Path) -> None:
    base = [*TINY, *FULL, "--train_dataset.max_samples=16", "--training.steps=3"]
    precompute = "--training.pref_ref_logps=precompute"
    runs = [Run(CONFIG, [*base, f"--training.output_dir={tmp_path / 'one'}"])] + [
        Run(CONFIG, [*base, *layout, precompute, f"--training.output_dir={tmp_path / key}"], 2)
        for key, layout in TABLE_LAYOUTS.items()
    ]
    train_all(runs)
    one = read_metrics(tmp_path / "one")
    failures = []
    for key in TABLE_LAYOUTS:
        assert len(list((tmp_path / key).glob("reference_logps-*.npz"))) == 1  # in the run folder
        got = read_metrics(tmp_path / key)
        assert len(got) == len(one) == 3
        for a, b in zip(one, got, strict=True):
            assert b["pairs"] == a["pairs"] == 8
            failures += [
                f"{key} step {a['step']} {m}: {b[m]} != {a[m]}"
                for m in (*METRICS, "grad_norm")
                if b[m] != pytest.approx(a[m], rel=1e-4 if m == "grad_norm" else 1e-5, abs=ABS.get(m, 1e-7))
            ]
    assert not failures, "\n".join(failures)
