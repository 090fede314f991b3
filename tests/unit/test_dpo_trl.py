"""meshforge's preference step against TRL's on the same tiny model and batch: losses and gradients.

TRL (test-only: `pip install --no-deps --target build/trl-ref trl==1.16.0`, found through
`TRL_REF` or `build/trl-ref`) runs its own code on a transformers Qwen3: for sigmoid DPO, hinge and IPO,
`DPOTrainer._compute_loss` (its concatenated forward through `add_fused_lm_head`: chosen rows,
then rejected rows, with a frozen reference copy), called on a stand-in for the trainer that
holds only the attributes that method reads; for SimPO (in TRL's CPO trainer), the length-averaged
`CPOTrainer.get_batch_logps` on the model's logits and `CPOTrainer.cpo_loss`. meshforge runs
`train/preference.py`'s `PreferenceStep.forward_backward` on its own Qwen3 with the same weights,
each pair as one row (chosen segment 1, rejected segment 2) or two pairs packed in one row
(segments 1-4), normalised by the number of pairs, through the full-logits path and the chunked
hidden-state path.
"""

from __future__ import annotations

import copy
import os
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
_ref = Path(os.environ.get("TRL_REF", REPO / "build" / "trl-ref"))
if _ref.is_dir() and str(_ref) not in sys.path:
    sys.path.insert(0, str(_ref))
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from meshforge.loss.preference import PreferenceLoss  # noqa: E402
from meshforge.models.qwen3.args import Qwen3Args  # noqa: E402
from meshforge.models.qwen3.model import Qwen3ForCausalLM  # noqa: E402
from meshforge.train.preference import PreferenceStep  # noqa: E402
from tests.unit._parity import load_from_hf, rel  # noqa: E402

ARGS = Qwen3Args(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_theta=10_000.0,
)
# (prompt, chosen, rejected) lengths of each pair.
LENGTHS = [(4, 6, 3), (3, 2, 7), (5, 5, 5)]
TOL = 1e-5


def _hf_model(seed: int):
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**ARGS.to_hf_dict())
    config._attn_implementation = "sdpa"
    return transformers.Qwen3ForCausalLM(config).float()


def _pairs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(1, ARGS.vocab_size, (n,), generator=g).tolist() for n in lengths]
        for lengths in LENGTHS
    ]


def _trl_batch(pairs):
    """TRL's concatenated layout: chosen rows, then rejected rows, right-padded."""
    seqs = [(p + c, len(p)) for p, c, _ in pairs] + [(p + r, len(p)) for p, _, r in pairs]
    width = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for i, (s, prompt) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        completion[i, prompt : len(s)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _pair_rows(pairs, per_row=1):
    """meshforge's layout: pair k of a row in segments 2k + 1 (chosen) and 2k + 2 (rejected), shifted labels."""
    rows = []
    for first in range(0, len(pairs), per_row):
        ids, unshifted, seg, pos = [], [], [], []
        for k, (p, c, r) in enumerate(pairs[first : first + per_row]):
            ids += p + c + p + r
            unshifted += [-100] * len(p) + c + [-100] * len(p) + r
            seg += [2 * k + 1] * (len(p) + len(c)) + [2 * k + 2] * (len(p) + len(r))
            pos += list(range(len(p) + len(c))) + list(range(len(p) + len(r)))
        rows.append((ids, unshifted, seg, pos))
    width = max(len(r[0]) for r in rows)
    batch = {
        k: torch.zeros(len(rows), width, dtype=torch.long)
        for k in ("input_ids", "segment_ids", "position_ids")
    }
    labels = torch.full((len(rows), width + 1), -100)
    for i, (ids, unshifted, seg, pos) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["segment_ids"][i, : len(ids)] = torch.tensor(seg)
        batch["position_ids"][i, : len(ids)] = torch.tensor(pos)
        labels[i, : len(ids)] = torch.tensor(unshifted)
    batch["labels"] = labels[:, 1:]
    return batch


def _stand_in(trainer_cls, model, ref_model, **fields):
    accelerator = types.SimpleNamespace(
        device=torch.device("cpu"),
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        unwrap_model=lambda m: m,
    )
    return types.SimpleNamespace(
        model=model,
        ref_model=ref_model,
        accelerator=accelerator,
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_weights=[1.0],
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        label_smoothing=0.0,
        alpha=0.0,
        **fields,
    )


def _trl_loss(loss_type: str, beta: float, gamma: float, pairs, hf, hf_ref) -> torch.Tensor:
    from trl.experimental.cpo import CPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    batch = _trl_batch(pairs)
    if loss_type == "simpo":
        me = _stand_in(CPOTrainer, hf, None, loss_type="simpo", beta=beta, simpo_gamma=gamma)
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
        chosen, rejected = logps.chunk(2)
        losses, _, _ = CPOTrainer.cpo_loss(me, chosen, rejected)
        return losses.mean()
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(hf, outputs=outputs)
    add_fused_lm_head(hf_ref, outputs=outputs)
    me = _stand_in(DPOTrainer, hf, hf_ref, loss_types=[loss_type], beta=beta)
    return DPOTrainer._compute_loss(me, hf, batch, False)


@pytest.mark.parametrize(
    "chunk_size,per_row", [(None, 1), (4, 1), (4, 2)], ids=["logits", "chunked", "chunked-packed"]
)
@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("hinge", 0.1), ("ipo", 0.5), ("simpo", 2.0)])
def test_loss_and_gradients_equal_trl(loss_type, beta, chunk_size, per_row):
    gamma = 0.5
    pairs = _pairs()
    hf_ref, hf = _hf_model(0), _hf_model(1)  # the policy differs from its reference
    hf.train()
    hf_ref.eval().requires_grad_(False)
    ours, ours_ref = Qwen3ForCausalLM(ARGS), Qwen3ForCausalLM(ARGS)
    load_from_hf(ours, hf)
    load_from_hf(ours_ref, copy.deepcopy(hf_ref))
    ours_ref.eval().requires_grad_(False)

    want = _trl_loss(loss_type, beta, gamma, pairs, hf, hf_ref)
    want.backward()

    step = PreferenceStep(
        loss=PreferenceLoss(loss_type=loss_type, beta=beta, simpo_gamma=gamma),
        lora=False,
        reference=ours_ref,
        chunk_size=chunk_size,
        compute_dtype=torch.float32,
        autocast=False,
        device=torch.device("cpu"),
    )
    batch = _pair_rows(pairs, per_row)  # packed: pairs 0 and 1 share a row, pair 2 is alone
    pairs_count = step.count_pairs(batch).to(torch.float32)
    loss_sum = step.forward_backward(ours, batch, pairs_count)
    got = loss_sum / pairs_count
    assert float(want.detach()) > 0.05
    assert rel(got.double(), want.detach().double()) <= TOL, (float(got), float(want))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    total = torch.cat([g.flatten() for g in hf_grads.values()]).norm()
    assert total > 0
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert rel(p.grad.double(), hf_grads[name].double()) <= TOL, name
    metrics = step.step_metrics(None)
    assert metrics["pairs"] == len(LENGTHS)
