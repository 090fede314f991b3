"""mamba3 under tensor, data and pipeline parallelism on 2 gloo ranks equals one process.

One spawn checks every layout against a single-process reference with the same weights and data:

* tp2: logits, loss and every gradient (gathered, in its parameter's layout) within 1e-5 of the
  reference's norm (or of a float64 run where float32 rounding is larger), with and without
  sequence and loss parallelism, packed documents, MIMO heads with two B/C groups split with the
  heads and SISO heads with one group kept whole; then three AdamW steps from a meta-device
  build (TP applied before materialisation) give the one-process losses;
* dp2 (FSDP2, each rank half of the rows): three AdamW steps give the one-process losses;
* pp2 (1f1b, an uneven split, packed documents restarting the state on whichever stage runs the
  layer): two steps give the CE sums and gradients of one process.

Every mixer runs chunks of 4 tokens, so the state is carried across chunks.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests._compare import assert_close, assert_scalar_close
from tests.distributed._layouts import run_checks

pytestmark = pytest.mark.slow

COMMON = {"vocab_size": 64, "hidden_size": 32, "state_size": 8, "head_dim": 8, "chunk_size": 4}
# 8 heads; MIMO rank 2 with the gated output norm, B/C in 2 groups (split over TP); tied head.
MIMO = {
    **COMMON,
    "num_hidden_layers": 2,
    "is_mimo": True,
    "mimo_rank": 2,
    "is_outproj_norm": True,
    "n_groups": 2,
}
# 8 SISO heads, one B/C group (whole on every TP rank); untied head.
SISO = {**COMMON, "num_hidden_layers": 3, "tie_word_embeddings": False}
# (name, options, apply_tp keyword arguments, packed)
TP_CASES = [
    ("mimo groups packed loss-parallel", MIMO, {"loss_parallel": True}, True),
    ("siso untied packed", SISO, {}, True),
    ("siso untied no SP packed", SISO, {"sequence_parallel": False}, True),
]
SEQ = 16


def _batch(seed: int, packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(0, 64, (2, SEQ), generator=g),
        "labels": torch.randint(0, 64, (2, SEQ), generator=g),
    }
    if packed:
        batch["segment_ids"] = torch.tensor([[1] * 6 + [2] * 10, [1] * 9 + [2] * 5 + [0] * 2])
    return batch


def _vary(model: torch.nn.Module) -> None:
    """Norms, biases and MIMO weights start at constants: vary them so a wrong layout shows."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum

    logits = model(batch["input_ids"], segment_ids=batch.get("segment_ids"))
    return logits, cross_entropy_sum(logits, batch["labels"]) / count_valid_tokens(batch["labels"])


def _check_tp(_rank: int, mesh, *, name: str, options: dict, kwargs: dict, packed: bool) -> None:
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    ref = resolve_family("mamba3").build(options, device="cpu")
    _vary(ref)
    tp, ref64 = copy.deepcopy(ref), copy.deepcopy(ref).to(torch.float64)
    apply_tp(tp, mesh, family="mamba3", **kwargs)
    batch = _batch(3, packed)
    results = []
    for model in (ref, ref64, tp):
        logits, loss = _loss(model, batch)
        loss.backward()
        results.append((logits, loss))
    (ref_logits, ref_loss), (logits64, loss64), (logits, loss) = results
    assert_close(logits, ref_logits, want64=logits64, what=(name, "logits"))
    assert_close(loss, ref_loss, want64=loss64, what=(name, "loss"))
    grads = {n: p.grad for n, p in ref.named_parameters()}
    grads64 = {n: p.grad for n, p in ref64.named_parameters()}
    plain = [n for n, p in tp.named_parameters() if not hasattr(p, "placements")]
    assert not plain, (name, "plain parameters", plain)
    assert [n for n, _ in tp.named_parameters()] == list(grads), (name, "parameter names changed")
    for n, p in tp.named_parameters():
        assert p.grad is not None and p.grad.placements == p.placements, (name, n)
        assert_close(p.grad, grads[n], want64=grads64[n], what=(name, n))


def _check_tp_training(_rank: int, mesh) -> None:
    """Three AdamW steps (SP, loss parallel) from the trainer's meta build give one process's losses."""
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.tensor import apply_tp

    spec = resolve_family("mamba3")
    ref, tp = spec.build(MIMO), spec.build(MIMO)
    apply_tp(tp, mesh, family="mamba3", loss_parallel=True)
    for model in (ref, tp):
        materialize_and_init(model, device=torch.device("cpu"), seed=5, init_fn=model.init_full_parameter_)
    for n, p in tp.named_parameters():
        assert torch.equal(p.detach().full_tensor(), ref.get_parameter(n).detach()), ("meta build", n)
    _same_losses([ref, tp], what="tp2 AdamW")


def _same_losses(models: list[torch.nn.Module], *, what: str, rows: slice | None = None) -> None:
    import torch.distributed as dist

    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    for step in range(3):
        batch = _batch(step, packed=step == 1)
        losses = []
        for i, (model, optim) in enumerate(zip(models, optims, strict=True)):
            optim.zero_grad()
            part = {k: v[rows] for k, v in batch.items()} if i and rows is not None else batch
            _, loss = _loss(model, part)
            loss.backward()
            optim.step()
            value = loss.detach().clone()
            if i and rows is not None:
                dist.all_reduce(value)
                value /= dist.get_world_size()
            losses.append(value.item())
        assert_scalar_close(losses[1], losses[0], what=(what, "step", step))


def _check_dp(rank: int, mesh) -> None:
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply_fsdp

    ref = resolve_family("mamba3").build(SISO, device="cpu")
    _vary(ref)
    dp = copy.deepcopy(ref)
    apply_fsdp(dp, mesh, param_dtype=None, reduce_dtype=torch.float32)
    # Every row has 16 labelled tokens, so the mean of the two ranks' means is the global mean.
    _same_losses([ref, dp], what="dp2 AdamW", rows=slice(rank, rank + 1))


def _check_pp(rank: int, mesh) -> None:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.pipeline import build_pipeline, split_model

    def build() -> torch.nn.Module:
        model = resolve_family("mamba3").build(SISO, device="cpu")
        _vary(model)
        return model

    micro = [_batch(10 + i, packed=True) for i in range(4)]
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    split = split_model(build(), pp_rank=rank, pp_size=2, layers_per_stage=["0", "1-2"], schedule="1f1b")
    opt = torch.optim.AdamW(split.model.parameters(), lr=1e-2, weight_decay=0.1)
    pipe = build_pipeline(split, split.model, mesh, device="cpu", n_microbatches=4, schedule="1f1b")
    for step in range(2):
        ref_opt.zero_grad()
        want = torch.zeros(())
        for mb in micro:
            ce = cross_entropy_sum(ref(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
            (ce / tokens).backward()
            want += ce.detach()
        opt.zero_grad()
        got = pipe.step(micro, tokens)
        assert_close(got, want, floor=1e-6, what=("pp2 CE sum", step, rank))
        for n, p in split.model.named_parameters():
            assert p.grad is not None, n
            assert_close(
                p.grad, ref.get_parameter(n).grad, floor=1e-4 if step else 1e-6, what=("pp2", step, n)
            )
        ref_opt.step()
        opt.step()


def test_mamba3_tp2_dp2_pp2_equal_one_process() -> None:
    tp = [
        (
            f"tp2 {name}",
            functools.partial(_check_tp, name=name, options=options, kwargs=kwargs, packed=packed),
        )
        for name, options, kwargs, packed in TP_CASES
    ]
    run_checks([*tp, ("tp2 AdamW", _check_tp_training), ("dp2", _check_dp), ("pp2", _check_pp)])
