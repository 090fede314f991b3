"""`training.pref_ref_logps: precompute`: the reference table gives the losses of a reference forward.

A tiny Qwen3 (configs/qwen3/dpo_lora.yaml) trains 3 steps with each reference choice, with a
validation split evaluated every step: losses, gradient norms, rewards and validation metrics agree
(norm-relative; the table's forwards batch the rows differently from the steps). A second run on
the same cached pair rows (`tokenized_path`) loads the table instead of computing it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.unit.test_dpo_train import CONFIG, FULL, TINY

KEYS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "eval_loss",
    "eval_rewards/margins",
)
BASE = [
    *TINY,
    "--train_dataset.max_samples=20",
    "--train_dataset.val_size=4",
    "--training.eval_interval=1",
    "--training.steps=3",
]


def _series(out) -> np.ndarray:
    return np.array([[r[k] for k in KEYS] for r in read_metrics(out)], dtype=np.float64)


def _close(got: np.ndarray, want: np.ndarray, rel: float = 1e-5) -> None:
    for j, key in enumerate(KEYS):
        diff = np.linalg.norm(got[:, j] - want[:, j]) / max(np.linalg.norm(want[:, j]), 1e-12)
        assert diff < rel, (key, got[:, j], want[:, j])


def _watch_the_reference_copy(monkeypatch) -> list[bool]:
    """After each table pass, whether the reference copy it built is still alive."""
    import gc
    import weakref

    from meshforge.train import build, build_preference

    built: list[weakref.ref] = []
    alive: list[bool] = []
    make, attach = build_preference.build_reference, build.precompute_reference

    def record(*args, **kwargs):
        module = make(*args, **kwargs)
        built.append(weakref.ref(module))
        return module

    def check(*args, **kwargs):
        attach(*args, **kwargs)
        gc.collect()
        alive.extend(ref() is not None for ref in built)

    monkeypatch.setattr(build_preference, "build_reference", record)
    monkeypatch.setattr(build, "precompute_reference", check)
    return alive


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--lr_scheduler.learning_rate=2e-2", "--training.pref_loss=ipo"], id="lora-ipo"),
        pytest.param(FULL, id="full-sigmoid"),
    ],
)
def test_precomputed_reference_gives_the_same_losses(tmp_path, monkeypatch, extra):
    model_run, table_run, again = tmp_path / "model", tmp_path / "table", tmp_path / "again"
    tok = tmp_path / "tok"
    base = [*BASE, *extra, f"--train_dataset.tokenized_path={tok}"]
    train_one(CONFIG, [*base, f"--training.output_dir={model_run}"], cwd=tmp_path)
    precompute = [*base, "--training.pref_ref_logps=precompute"]
    copies = _watch_the_reference_copy(monkeypatch)
    run = train_one(CONFIG, [*precompute, f"--training.output_dir={table_run}"], cwd=tmp_path)
    # Full fine-tuning builds the copy for the pass only; it is gone before the optimizer exists.
    assert copies == ([False] if extra is FULL else [])
    assert "reference model: precomputed log-probabilities" in run.stdout
    assert "reference log-probabilities of 20 rows computed in" in run.stdout
    assert len(list(tok.glob("reference_logps-*.npz"))) == 1  # beside the cached pair rows
    _close(_series(table_run), _series(model_run))
    # A rerun on the same data: the table is read back, the reference model never built.
    rerun = train_one(CONFIG, [*precompute, f"--training.output_dir={again}"], cwd=tmp_path)
    assert "reference log-probabilities of 20 rows loaded from" in rerun.stdout
    assert _series(again).tolist() == _series(table_run).tolist()


def test_lookup_matches_the_forward_on_packed_rows():
    """Rows of several pairs (and an empty slot): the table's lookup equals the reference forward."""
    from meshforge.loss.preference import PreferenceLoss
    from meshforge.train.preference import PreferenceStep
    from meshforge.train.reference_table import ROW_INDEX, ReferenceTable

    torch.manual_seed(0)
    vocab, hidden = 32, 8
    head = torch.nn.Linear(hidden, vocab, bias=False)
    embed = torch.nn.Embedding(vocab, hidden)

    class Tiny(torch.nn.Module):
        def forward(self, ids, **_):
            return head(embed(ids))

    seg = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 4, 4, 0], [1, 1, 2, 2, 2, 0, 0, 0, 0, 0]])
    ids = torch.randint(0, vocab, seg.shape)
    labels = torch.where(seg > 0, torch.randint(0, vocab, seg.shape), -100)
    labels[1, :2] = -100  # the second row's chosen answer has no counted label
    batch = {"input_ids": ids, "labels": labels, "segment_ids": seg, ROW_INDEX: torch.tensor([1, 0])}
    step = PreferenceStep(
        loss=PreferenceLoss(), lora=False, reference=Tiny(), chunk_size=None,
        compute_dtype=torch.float32, autocast=False, device=torch.device("cpu"),
    )  # fmt: skip
    want = step.reference_forward(Tiny(), batch)
    table = ReferenceTable()
    sums = torch.stack([want.chosen, want.rejected], 1).view(2, 2, 2)
    table.values = torch.stack([sums[1], sums[0]])  # row_index 1 is the batch's first row
    got = table.lookup(batch)
    for name in ("chosen", "rejected", "chosen_tokens", "rejected_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.rejected[3] == -1.0 and got.chosen[2] == 0.0  # the empty slot; no counted label


def test_validate_names_what_each_reference_choice_costs():
    """`config validate`: the frozen copy's weights are in the predicted peak, the table's pass is not."""
    from meshforge.config import load_config
    from meshforge.parallel.device_peak import peak_lines
    from meshforge.parallel.plan import plan_lines

    def plan(*overrides: str) -> tuple[str, float]:
        cfg = load_config(
            str(CONFIG), [*overrides, "--model.hidden_size=512", "--model.intermediate_size=1536"]
        )
        lines = plan_lines(cfg, 2) + peak_lines(cfg, 2)
        reference = next(line for line in lines if line.startswith("dpo reference model:"))
        peak = next(line for line in lines if line.startswith("predicted peak per rank"))
        return reference, float(peak.split(" GiB allocated")[0].split("= ")[-1])

    adapters, lora_peak = plan()
    table_lora, table_lora_peak = plan("--training.pref_ref_logps=precompute")
    copy, copy_peak = plan("--lora_config=null")
    table, table_peak = plan("--lora_config=null", "--training.pref_ref_logps=precompute")
    assert "LoRA adapters disabled: no extra weights" in adapters and table_lora_peak == lora_peak
    assert "with the policy with its LoRA adapters disabled" in table_lora
    assert copy.startswith("dpo reference model: a frozen copy sharded as the policy: +")
    weights = float(copy.split(": +")[1].split(" GiB")[0])
    assert "included in the predicted peak" in copy
    assert table.startswith("dpo reference model: precomputed (training.pref_ref_logps: precompute)")
    assert "8 bytes a pair" in table and f"+{weights:.2f} GiB per rank during that pass only" in table
    assert weights >= 0.03 and copy_peak - table_peak == pytest.approx(weights, abs=0.016)
