"""meshforge's ORPO against LLaMA-Factory 0.9.5's on the same tiny model and batch: loss and gradients.

LLaMA-Factory's DPO trainer module imports a TRL older than the one the tests install, so its
own functions are read from its source (`build/llamafactory-ref`, or `LF_REF`; `make test` installs
it) and run as written: `get_batch_logps` (trainer_utils.py) on a transformers Qwen3's logits of
the concatenated batch (chosen rows, then rejected rows), divided by each answer's length as
`CustomDPOTrainer.concatenated_forward` does for orpo, then `CustomDPOTrainer.odds_ratio_loss`
and its `pref_ftx` term (`get_batch_loss_metrics`: `losses += ftx_gamma * sft_loss`, the mean over
the pairs). meshforge runs `PreferenceStep.forward_backward` on its own Qwen3 with the same weights
(TRL's CPOTrainer has no orpo loss; its ORPOTrainer's SFT term is a token mean over the whole
batch, not LLaMA-Factory's per-answer mean, so it is not the reference here).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshforge.loss.preference import PreferenceLoss
from meshforge.models.qwen3.model import Qwen3ForCausalLM
from meshforge.train.preference import ORPO_KEYS, PreferenceStep
from tests.unit._parity import load_from_hf, rel
from tests.unit.test_dpo_trl import ARGS, LENGTHS, TOL, _hf_model, _pair_rows, _pairs, _trl_batch

REPO = Path(__file__).resolve().parents[2]
LF = Path(os.environ.get("LF_REF", REPO / "build" / "llamafactory-ref")) / "llamafactory" / "train"
pytestmark = pytest.mark.skipif(not LF.is_dir(), reason="LLaMA-Factory 0.9.5 is not installed (make test)")


def _lf_function(path: Path, name: str, owner: str | None = None):
    """LLaMA-Factory's function (or method of `owner`) `name`, compiled from its source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = tree.body
    if owner is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    scope = {"torch": torch, "F": F, "Optional": __import__("typing").Optional, "IGNORE_INDEX": -100}
    exec(compile(ast.Module([node], []), str(path), "exec"), scope)  # noqa: S102 - the reference's own code
    return scope[name]


def _lf_loss(hf, pairs, beta: float, ftx: float) -> tuple[torch.Tensor, dict[str, float]]:
    get_batch_logps = _lf_function(LF / "trainer_utils.py", "get_batch_logps")
    odds_ratio_loss = _lf_function(LF / "dpo" / "trainer.py", "odds_ratio_loss", "CustomDPOTrainer")
    batch = _trl_batch(pairs)  # chosen rows, then rejected rows, right-padded
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logps, length = get_batch_logps(logits=logits, labels=labels)
    chosen, rejected = (logps / length).split(len(pairs))
    losses = odds_ratio_loss(type("Trainer", (), {"beta": beta})(), chosen, rejected)
    sft_loss = -chosen
    metrics = {
        "sft_loss": sft_loss.mean().item(),
        "odds_ratio_loss": ((losses - sft_loss) / beta).mean().item(),
    }
    if ftx > 1e-6:
        losses = losses + ftx * sft_loss
    return losses.mean(), metrics


@pytest.mark.parametrize("chunk_size,per_row", [(None, 1), (4, 2)], ids=["logits", "chunked-packed"])
@pytest.mark.parametrize("ftx", [0.0, 0.5])
def test_orpo_loss_and_gradients_equal_llamafactory(chunk_size, per_row, ftx):
    beta = 0.25
    pairs = _pairs()
    hf = _hf_model(1)
    hf.train()
    ours = Qwen3ForCausalLM(ARGS)
    load_from_hf(ours, hf)
    want, lf_metrics = _lf_loss(hf, pairs, beta, ftx)
    want.backward()

    step = PreferenceStep(
        loss=PreferenceLoss(loss_type="orpo", beta=beta, ftx=ftx),
        lora=False,
        reference=None,
        chunk_size=chunk_size,
        compute_dtype=torch.float32,
        autocast=False,
        device=torch.device("cpu"),
        keys=(*PreferenceStep.keys, *ORPO_KEYS),
    )
    batch = _pair_rows(pairs, per_row)
    count = step.count_pairs(batch).to(torch.float32)
    got = step.forward_backward(ours, batch, count) / count
    assert float(want.detach()) > 0.5
    assert rel(got.double(), want.detach().double()) <= TOL, (float(got), float(want))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert torch.cat([g.flatten() for g in hf_grads.values()]).norm() > 0
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert rel(p.grad.double(), hf_grads[name].double()) <= TOL, name
    metrics = step.step_metrics(None)
    assert metrics["pairs"] == len(LENGTHS)
    if ftx == 0.0:  # LLaMA-Factory's odds_ratio_loss metric folds the ftx term in
        for key in ORPO_KEYS:
            assert metrics[key] == pytest.approx(lf_metrics[key], rel=1e-5), key
