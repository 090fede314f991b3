"""The MoE router aux loss under context and pipeline parallelism equals one process (2 ranks, gloo).

transformers' load-balancing loss is one product of totals over all tokens and all MoE layers,
so neither a CP rank (part of every sequence) nor a pipeline stage (part of the layers) can form
it alone. One launch checks, against a single process with the same weights and data:

* cp2 (ulysses and the colossal ring, packed documents with padding) on qwen3_moe: the aux value
  on every rank, the logged value (each rank's aux times its token share, summed), and every
  gradient of ``CE / tokens + coef * aux * share`` (the trainer's objective), summed over the
  ranks; plus the negative control that without ``set_aux_reduce_group`` the rank's value is
  not the model's.
* cp2 on gpt_oss' MoE block (its own router with bias and softmax statistics), the CP rank's
  slice of each row in the colossal layout: value and router and input gradients.
* pp2 with the aux loss on (carried through the stages): qwen3_moe 1f1b, gpt_oss interleaved
  and zero bubble, qwen3_next interleaved whose first stage has only a dense layer: CE sum,
  logged aux sum and every gradient, 1e-5 relative.

A 4-process launch runs qwen3_moe on pp2 x cp2 (the colossal ring): the last stage sums the
carried totals over the CP group before the product.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._compare import assert_close
from tests.distributed._spawn import run_workers
from tests.distributed.test_pp_families import N_MICRO, build_family, micro_batches

pytestmark = pytest.mark.slow

WORLD = 2
SEQ = 16
COEF = 0.5  # large, so the aux term is a visible part of every router gradient


def _moe_args():
    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs

    return Qwen3MoeArgs(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=10_000.0,
        output_router_logits=True,
    )


def _cp_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    seg = torch.tensor([[1] * 5 + [2] * 9 + [0] * 2, [1] * 16])
    labels = torch.randint(0, 64, (2, SEQ), generator=g)
    labels[seg == 0] = -100
    return {"input_ids": torch.randint(0, 64, (2, SEQ), generator=g), "labels": labels, "segment_ids": seg}


def _check_cp_qwen3_moe(method: str, mesh) -> None:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.models.common.moe import set_aux_reduce_group
    from meshforge.models.qwen3_moe.model import build_qwen3_moe
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    what = f"cp2 {method} qwen3_moe"
    batch = _cp_batch()
    tokens = count_valid_tokens(batch["labels"]).float()
    ref = build_qwen3_moe(_moe_args(), device="cpu")
    ce = cross_entropy_sum(ref(batch["input_ids"], segment_ids=batch["segment_ids"]), batch["labels"])
    want_aux = ref.aux_loss()
    (ce / tokens + COEF * want_aux).backward()  # one micro-batch: share 1

    model = build_qwen3_moe(_moe_args(), device="cpu")
    apply_cp(model, mesh, method=method)
    local = shard_batch_for_cp(batch, mesh, method=method)
    # Negative control: the rank's own statistics do not give the model's loss.
    with torch.no_grad():
        model(local["input_ids"], local["position_ids"], local["segment_ids"])
        alone = model.aux_loss()
    assert (alone - want_aux).abs() > 1e-4 * want_aux.abs(), (what, "control", alone, want_aux)

    assert set_aux_reduce_group(model, mesh) == 2
    logits = model(local["input_ids"], local["position_ids"], local["segment_ids"])
    aux = model.aux_loss()
    assert_close(aux.detach(), want_aux.detach(), floor=1e-6, what=f"{what}: aux value")
    share = count_valid_tokens(local["labels"]).float() / tokens
    (cross_entropy_sum(logits, local["labels"]) / tokens + COEF * aux * share).backward()
    logged = (aux.detach() * share).clone()
    dist.all_reduce(logged, group=mesh.get_group())
    assert_close(logged, want_aux.detach(), floor=1e-6, what=f"{what}: logged aux")
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert_close(grad, q.grad, floor=1e-6, what=f"{what}: grad {name}")


def _check_cp_gpt_oss_block(mesh) -> None:
    from meshforge.models.common.moe import load_balancing_loss, set_aux_reduce_group
    from meshforge.models.gpt_oss.moe import GptOssMLP
    from meshforge.parallel.context import local_token_index

    def block() -> GptOssMLP:
        torch.manual_seed(7)
        mlp = GptOssMLP(32, 4, 2, 16, alpha=1.702, limit=7.0)
        with torch.no_grad():
            for p in mlp.parameters():
                p.normal_(0.0, 0.5)
        return mlp

    what = "cp2 gpt_oss block"
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, SEQ, 32, generator=g)
    keep = torch.ones(2, SEQ, dtype=torch.bool)
    keep[0, -3:] = False  # padding: out of the statistics
    ref = block()
    xr = x.clone().requires_grad_(True)
    ref(xr, keep)
    want = load_balancing_loss([ref.last_aux_stats], 4)
    want.backward()

    mine = block()
    assert set_aux_reduce_group(mine, mesh.get_group()) == 1
    index = local_token_index(SEQ, WORLD, dist.get_rank(mesh.get_group()), method="colossal")
    xl = x[:, index].clone().requires_grad_(True)
    mine(xl, keep[:, index])
    aux = load_balancing_loss([mine.last_aux_stats], 4)
    assert_close(aux.detach(), want.detach(), floor=1e-6, what=f"{what}: aux value")
    share = keep[:, index].sum().float() / keep.sum().float()
    (aux * share).backward()
    assert_close(xl.grad, xr.grad[:, index], floor=1e-6, what=f"{what}: input grad")
    for (name, p), (_, q) in zip(mine.router.named_parameters(), ref.router.named_parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert_close(grad, q.grad, floor=1e-6, what=f"{what}: router.{name} grad")


def _qwen3_moe_pp(tied: bool):
    from dataclasses import replace

    from meshforge.models.qwen3_moe.model import build_qwen3_moe

    return build_qwen3_moe(replace(_moe_args(), num_hidden_layers=3, tie_word_embeddings=tied), device="cpu")


# (name, family, schedule, interleave, layers_per_stage, fsdp)
PP_CASES = [
    ("qwen3_moe 1f1b uneven", "qwen3_moe", "1f1b", 1, ["0", "1-2"], False),
    # The stages call the FSDP root (on a 1-rank data mesh), as under the trainer.
    ("qwen3_moe 1f1b fsdp", "qwen3_moe", "1f1b", 1, ["0-1", "2"], True),
    ("gpt_oss interleaved uneven", "gpt_oss", "interleaved", 2, ["0,3", "1-2,4"], False),
    # Stage 0 runs only the dense layer 0: its carry starts the sums with nothing to add.
    ("qwen3_next interleaved dense first stage", "qwen3_next", "interleaved", 2, ["0,2-3", "1,4"], False),
    # Separate input- and weight-gradient passes: the carry's gradient is an input gradient.
    ("gpt_oss zero bubble", "gpt_oss", "zero_bubble", 2, ["0-1,3", "2,4"], False),
]


def _pp_model(family: str):
    if family == "qwen3_moe":
        return _qwen3_moe_pp(tied=False)
    return build_family(family, tied=True, aux=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_pp(rank: int, case, pp_mesh, dp_mesh) -> None:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.parallel.fsdp import apply_fsdp
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name, family, schedule, interleave, spec, fsdp = case
    micro = micro_batches()
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    ref = _pp_model(family)
    want_ce = torch.zeros(())
    want_aux = torch.zeros(())
    for mb in micro:
        ce = cross_entropy_sum(ref(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
        aux = ref.aux_loss()
        share = count_valid_tokens(mb["labels"]).float() / tokens
        (ce / tokens + COEF * aux * share).backward()
        want_ce += ce.detach()
        want_aux += aux.detach() * share
    want_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}

    split = split_model(
        _pp_model(family),
        pp_rank=rank,
        pp_size=WORLD,
        layers_per_stage=spec,
        interleave=interleave,
        schedule=schedule,
    )
    if fsdp:
        apply_fsdp(split.model, dp_mesh, param_dtype=None, reduce_dtype=torch.float32, pipeline_parallel=True)
    pipe = build_pipeline(
        split, split.model, pp_mesh, device="cpu", n_microbatches=N_MICRO, schedule=schedule, aux_coef=COEF
    )
    assert pipe.aux_experts == 4
    ce = pipe.step(micro, tokens)
    assert_close(ce, want_ce, floor=1e-6, what=f"[pp {name}] CE sum on rank {rank}")
    assert_close(pipe.aux_sum, want_aux, floor=1e-6, what=f"[pp {name}] logged aux sum on rank {rank}")
    for n, p in split.model.named_parameters():
        assert p.grad is not None, f"[pp {name}] {n} has no grad"
        assert_close(_full(p.grad), want_grads[n], floor=1e-6, what=f"[pp {name}] grad {n}")
    # Evaluation runs the same stages (with the carry) and leaves the logged training value alone.
    logged = pipe.aux_sum.clone()
    with torch.no_grad():
        assert_close(pipe.evaluate(micro), want_ce, floor=1e-6, what=f"[pp {name}] evaluate CE sum")
    assert torch.equal(pipe.aux_sum, logged)


def _check_pp_cp(rank: int, family: str, mesh) -> None:
    """pp2 x cp2: the carried totals of each CP rank are summed over the CP group on the last stage."""
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.models.common.moe import set_aux_reduce_group
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp
    from meshforge.parallel.pipeline import build_pipeline, split_model

    name = f"pp2 x cp2 {family}"
    micro = micro_batches()
    tokens = sum(count_valid_tokens(mb["labels"]) for mb in micro)
    ref = _pp_model(family)
    want_ce, want_aux = torch.zeros(()), torch.zeros(())
    for mb in micro:
        ce = cross_entropy_sum(ref(mb["input_ids"], segment_ids=mb["segment_ids"]), mb["labels"])
        aux = ref.aux_loss()
        share = count_valid_tokens(mb["labels"]).float() / tokens
        (ce / tokens + COEF * aux * share).backward()
        want_ce += ce.detach()
        want_aux += aux.detach() * share
    want_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}

    pp, cp = mesh["pp"], mesh["cp"]
    split = split_model(
        _pp_model(family), pp_rank=pp.get_local_rank(), pp_size=2, layers_per_stage=["0", "1-2"]
    )
    apply_cp(split.model, cp, method="colossal")
    set_aux_reduce_group(split.model, cp)
    pipe = build_pipeline(split, split.model, pp, device="cpu", n_microbatches=N_MICRO, aux_coef=COEF)
    local = [shard_batch_for_cp(mb, cp, method="colossal") for mb in micro]
    ce = pipe.step(local, tokens)
    both = torch.stack([ce, pipe.aux_sum])
    dist.all_reduce(both, group=cp.get_group())  # as the trainer's loss-group sums
    assert_close(both[0], want_ce, floor=1e-6, what=f"[{name}] CE sum on rank {rank}")
    assert_close(both[1], want_aux, floor=1e-6, what=f"[{name}] logged aux sum on rank {rank}")
    for n, p in split.model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp.get_group())  # as FSDP over the cp ranks would
        assert_close(grad, want_grads[n], floor=1e-6, what=f"[{name}] grad {n}")


def _worker4(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    _check_pp_cp(rank, "qwen3_moe", mesh)


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("cp", "dp"))
    for method in ("ulysses", "colossal"):
        _check_cp_qwen3_moe(method, mesh["cp"])
    _check_cp_gpt_oss_block(mesh["cp"])
    for case in PP_CASES:  # the same 2 ranks as a pipeline
        _check_pp(rank, case, mesh["cp"], mesh["dp"])


def test_router_aux_loss_cp2_and_pp2_equal_one_process() -> None:
    run_workers(_worker, WORLD)


def test_router_aux_loss_pp2_cp2_equals_one_process() -> None:
    run_workers(_worker4, 4)


def test_trainer_aux_loss_under_pp2_and_cp2_equals_one_process(tmp_path) -> None:
    """`meshforge train` on qwen3_moe with the router aux loss on: pp2 (1f1b) and cp2 (colossal)
    log the single-process loss, aux loss and grad norm at every step."""
    from tests.conftest import read_metrics
    from tests.distributed._layouts import train_one
    from tests.distributed.test_ep import REPO, TRAIN, _assert_same_steps

    config = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
    common = [*TRAIN, "--checkpoint.enable_save=false"]
    layouts = {
        "one": (1, []),
        "pp2": (2, ["--parallelism.pipeline_parallel=2"]),
        "cp2": (2, ["--parallelism.context_parallel=2"]),
    }
    for name, (nproc, extra) in layouts.items():
        train_one(
            config, [*common, *extra, f"--training.output_dir={tmp_path / name}"], nproc=nproc, cwd=tmp_path
        )
    one = read_metrics(tmp_path / "one")
    assert all(r["aux_loss"] > 0 for r in one)
    for name in ("pp2", "cp2"):
        _assert_same_steps(one, read_metrics(tmp_path / name))
