"""FSDP ignored modules and shard placement functions equal one process (2 gloo ranks, one spawn).

Each rank builds a tiny qwen3 from the same seed and keeps it as the single-process reference,
trained on the whole global batch; a deep copy is sharded over 2 data-parallel ranks, each taking
half the batch. Both take 3 AdamW steps (meshforge's optimizer builder, clipping that really
clips, loss divided by the global token count as the trainer does); the sharded run calls
`sync_ignored_grads` after backward. Losses, grad norms and every full parameter must match within
1e-5 relative (parameters in L2 norm; see `_compare_params`). Cases: the embedding ignored (tied to lm_head), every MLP ignored, the pattern
path with ignored MLPs, a `CheckpointManager` save -> fresh model -> load -> one more step equal
to continuing (and the same checkpoint continuing in one process), the meta-device build the trainer uses, bf16 compute with fp32 ignored modules,
gradients present on one rank only, the shard placements `shard_by_dim_1` and a user function
given by its dotted path (expected DTensor placements, same losses), and HSDP 2x1 with both.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from meshforge.utils.seed import rng_state
from tests._compare import max_rel_error, rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

WORLD = 2
TOL = 1e-5
QWEN3 = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": False,
}
OPTIM = {
    "type": "AdamW",
    "learning_rate": 1e-3,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "weight_decay_include": None,
    "weight_decay_exclude": None,
    "options": {},
}
MAX_NORM = 0.5  # below the tiny model's grad norm (~3): every step clips
FSDP_MODULES = ["model.layers.{*}", "model.embed_tokens", "lm_head"]


def wide_on_dim1(param: torch.nn.Parameter) -> Shard | None:
    """User placement function (reached as `tests.distributed.test_fsdp_ignored:wide_on_dim1`)."""
    return Shard(1) if param.ndim == 2 else None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, QWEN3["vocab_size"], (2 * WORLD, 16), generator=g)
        labels = torch.randint(0, QWEN3["vocab_size"], (2 * WORLD, 16), generator=g)
        labels[0, :5] = -100  # uneven valid-token counts across ranks
        out.append({"input_ids": ids, "labels": labels})
    return out


def _build(options: dict) -> torch.nn.Module:
    from meshforge.models.registry import resolve_family

    torch.manual_seed(0)
    model = resolve_family("qwen3").build(options, device="cpu")
    with torch.no_grad():  # norm weights start at 1: vary them so a wrong gradient shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape) + 0.5)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    from meshforge.optim.build import build_optimizer

    return build_optimizer(model.named_parameters(), **OPTIM)


def _step(model, opt, batch, *, rank: int | None) -> tuple[float, float]:
    """One optimizer step; `rank` None = the single-process reference on the whole batch."""
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.optim.clip import clip_grad_norm_
    from meshforge.parallel.fsdp import sync_ignored_grads

    global_tokens = count_valid_tokens(batch["labels"]).float()
    if rank is not None:
        batch = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
    loss_sum = cross_entropy_sum(model(batch["input_ids"]), batch["labels"])
    (loss_sum / global_tokens).backward()
    if rank is not None:
        sync_ignored_grads(model, None)
        loss_sum = loss_sum.detach().clone()
        dist.all_reduce(loss_sum)
    norm = clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (loss_sum / global_tokens).item(), norm.item()


def _compare_params(case: str, model, ref) -> None:
    """Every full parameter equals the reference's: 1e-5 in L2 norm, 1e-4 element-wise.

    Adam divides each gradient by its own magnitude, so an element whose gradient is a
    cancellation near eps (summed in another order on 2 ranks) moves differently: measured, one
    embedding weight of 4096 with gradient -3.87e-7 vs -3.78e-7 ended 2.3e-6 apart (2.8e-5 of
    the tensor's largest weight) after 3 steps. A missing or wrong gradient sum moves every
    element by about lr (1e-3), far beyond either bound.
    """
    for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name, (case, name, ref_name)
        a, b = _full(p.detach()), _full(q.detach())
        assert rel_error(a, b) <= TOL and max_rel_error(a, b) <= 10 * TOL, (
            case,
            name,
            rel_error(a, b),
            max_rel_error(a, b),
        )


def _train_and_compare(case: str, ref, model, rank: int, steps: int = 3) -> list[tuple[float, float]]:
    ref_opt, opt = _optimizer(ref), _optimizer(model)
    out = []
    for i, batch in enumerate(_batches(steps)):
        ref_loss, ref_norm = _step(ref, ref_opt, batch, rank=None)
        loss, norm = _step(model, opt, batch, rank=rank)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (case, i, "loss", loss, ref_loss)
        assert abs(norm - ref_norm) <= TOL * abs(ref_norm), (case, i, "grad norm", norm, ref_norm)
        out.append((loss, norm))
    _compare_params(case, model, ref)
    return out


def _check_kinds(case: str, model, ignored: set[str]) -> None:
    from meshforge.parallel.fsdp import ignored_parameter_names

    assert set(ignored_parameter_names(model)) == ignored, (case, ignored_parameter_names(model))
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) == (name not in ignored), (case, name, type(p))


def _ignored_cases(mesh, rank: int) -> None:
    from meshforge.parallel.fsdp import apply_fsdp, apply_fsdp_patterns

    kw = {"param_dtype": None, "reduce_dtype": torch.float32}
    # 1. The (tied) embedding ignored: lm_head shares the plain parameter.
    ref = _build({**QWEN3, "tie_word_embeddings": True})
    model = apply_fsdp(copy.deepcopy(ref), mesh, ignored_modules=["model.embed_tokens"], **kw)
    _check_kinds("embed", model, {"model.embed_tokens.weight"})
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = _optimizer(model)
    # Groups 0/1 stay decay/no decay (DTensors); the plain embedding (decay) gets group 2.
    kinds = [{isinstance(p, DTensor) for p in g["params"]} for g in opt.param_groups]
    assert kinds == [{True}, {True}, {False}], kinds
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
    _train_and_compare("embed", ref, model, rank)

    # 2. Every MLP ignored, per-layer units; 3. the same by patterns.
    mlp = {f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(2) for n in ("gate", "up", "down")}
    ref = _build(QWEN3)
    model = apply_fsdp(copy.deepcopy(ref), mesh, ignored_modules=["model.layers.{*}.mlp"], **kw)
    _check_kinds("mlp", model, mlp)
    _train_and_compare("mlp", ref, model, rank)
    model = apply_fsdp_patterns(
        copy.deepcopy(ref := _build(QWEN3)),
        mesh,
        fsdp_modules=[*FSDP_MODULES, "model.layers.{*}.mlp"],
        ignored_modules=["model.layers.{*}.mlp"],
        **kw,
    )
    _check_kinds("patterns mlp", model, mlp)
    from torch.distributed.fsdp import FSDPModule

    # The all-ignored MLP units are not wrapped; their layers are.
    assert not isinstance(model.model.layers[0].mlp, FSDPModule)
    assert isinstance(model.model.layers[0], FSDPModule)
    _train_and_compare("patterns mlp", ref, model, rank)


def _checkpoint_case(mesh, rank: int, save_dir: Path) -> None:
    """Save through CheckpointManager (DCP), load into a fresh model: the next step equals continuing."""
    from meshforge.checkpoint.manager import CheckpointManager
    from meshforge.parallel.fsdp import apply_fsdp

    kw = {"param_dtype": None, "reduce_dtype": torch.float32, "ignored_modules": ["model.layers.{*}.mlp"]}
    init = _build(QWEN3)
    model = apply_fsdp(copy.deepcopy(init), mesh, **kw)
    opt = _optimizer(model)
    batches = _batches(3)
    for batch in batches[:2]:
        _step(model, opt, batch, rank=rank)
    manager = CheckpointManager(
        save_dir=save_dir,
        prefix="checkpoint",
        interval=1,
        keep=2,
        enabled=True,
        save_optimizer=True,
        rank=rank,
    )
    path = manager.save(2, model, opt, {"step": 2}, rng_state())
    fresh = apply_fsdp(copy.deepcopy(init), mesh, **kw)
    fresh_opt = _optimizer(fresh)
    manager.load(path, fresh, fresh_opt, load_optimizer=True)
    _compare_params("after load", fresh, model)
    # The plain (ignored) weights are whole on every rank after the load.
    assert not isinstance(fresh.model.layers[1].mlp.up_proj.weight, DTensor)
    # The same checkpoint in a one-process layout (no FSDP, two optimizer groups): the groups'
    # hyperparameters must come back right (DCP restores them by index).
    single = copy.deepcopy(init)
    single_opt = _optimizer(single)
    manager.load(path, single, single_opt, load_optimizer=True)
    assert [g["weight_decay"] for g in single_opt.param_groups] == [0.1, 0.0]
    a = _step(model, opt, batches[2], rank=rank)
    b = _step(fresh, fresh_opt, batches[2], rank=rank)
    assert a == b, ("resume", a, b)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(_full(p.detach()), _full(q.detach())), ("resume", name)
    c = _step(single, single_opt, batches[2], rank=None)
    assert abs(c[0] - a[0]) <= TOL * a[0] and abs(c[1] - a[1]) <= TOL * a[1], ("one process", a, c)
    _compare_params("resumed on one process", model, single)


def _meta_and_bf16_cases(mesh, rank: int) -> None:
    from meshforge.loss.cross_entropy import count_valid_tokens, cross_entropy_sum
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.fsdp import apply_fsdp

    # The trainer's order: meta build, FSDP, then materialise each parameter from the seed.
    family = resolve_family("qwen3")
    ref, model = family.build(QWEN3), family.build(QWEN3)
    apply_fsdp(
        model, mesh, param_dtype=None, reduce_dtype=torch.float32, ignored_modules=["model.layers.{*}.mlp"]
    )
    for m in (ref, model):
        materialize_and_init(m, device=torch.device("cpu"), seed=5, init_fn=m.init_full_parameter_)
    _compare_params("meta build", model, ref)

    # bf16 compute: FSDP units in bf16, the ignored MLPs in their fp32 weights; close to fp32.
    ref = _build(QWEN3)
    model = apply_fsdp(
        copy.deepcopy(ref),
        mesh,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        ignored_modules=["model.layers.{*}.mlp"],
    )
    batch = _batches(1)[0]
    local = {k: v.chunk(WORLD)[rank] for k, v in batch.items()}
    tokens = count_valid_tokens(batch["labels"]).float()
    # The dtype each linear really computed in: bf16 inside the FSDP units, fp32 in the MLPs.
    ran: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    watched = {"attention": model.model.layers[0].self_attn.q_proj, "mlp": model.model.layers[0].mlp.up_proj}

    def record(key: str):
        def hook(module: torch.nn.Module, args: tuple, _out: torch.Tensor) -> None:
            ran.setdefault(key, (args[0].dtype, module.weight.dtype))

        return hook

    hooks = [module.register_forward_hook(record(key)) for key, module in watched.items()]
    loss = cross_entropy_sum(model(local["input_ids"]), local["labels"]) / tokens
    for hook in hooks:
        hook.remove()
    assert ran == {"attention": (torch.bfloat16, torch.bfloat16), "mlp": (torch.float32, torch.float32)}, ran
    loss.backward()
    ref_loss = cross_entropy_sum(ref(batch["input_ids"]), batch["labels"]) / tokens
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    assert rel_error(loss, ref_loss.detach()) < 2e-2, ("bf16", loss.item(), ref_loss.item())
    assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.float32


def _partial_grads_case(mesh, rank: int) -> None:
    """A gradient on one rank only is summed with zeros; no gradient anywhere stays None."""
    from meshforge.parallel.fsdp import apply_fsdp, sync_ignored_grads

    model = apply_fsdp(
        _build(QWEN3),
        mesh,
        param_dtype=None,
        reduce_dtype=torch.float32,
        ignored_modules=["model.layers.{*}.mlp"],
    )
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight.grad = torch.full_like(mlp.up_proj.weight, float(rank + 1))
    if rank == 0:
        mlp.gate_proj.weight.grad = torch.full_like(mlp.gate_proj.weight, 5.0)
    assert sync_ignored_grads(model, None) == 2
    assert torch.equal(mlp.up_proj.weight.grad, torch.full_like(mlp.up_proj.weight, 3.0))
    assert torch.equal(mlp.gate_proj.weight.grad, torch.full_like(mlp.gate_proj.weight, 5.0))
    assert mlp.down_proj.weight.grad is None
    assert model.model.layers[1].mlp.up_proj.weight.grad is None


def _placement_cases(mesh, rank: int) -> None:
    from meshforge.parallel.fsdp import apply_fsdp, apply_fsdp_patterns

    kw = {"param_dtype": None, "reduce_dtype": torch.float32}
    # shard_by_dim_1 on every unit of the per-layer path, root included.
    ref = _build(QWEN3)
    model = apply_fsdp(copy.deepcopy(ref), mesh, shard_placement="shard_by_dim_1", **kw)
    for name, p in model.named_parameters():
        want = Shard(1) if p.ndim == 2 else Shard(0)
        assert p.placements == (want,), ("dim1", name, p.placements)
    _train_and_compare("shard_by_dim_1", ref, model, rank)

    # A user function on the first pattern's units only (MindSpeed); the rest keep dim 0.
    ref = _build(QWEN3)
    model = apply_fsdp_patterns(
        copy.deepcopy(ref),
        mesh,
        fsdp_modules=FSDP_MODULES,
        shard_placement="tests.distributed.test_fsdp_ignored:wide_on_dim1",
        **kw,
    )
    for name, p in model.named_parameters():
        want = Shard(1) if name.startswith("model.layers.") and p.ndim == 2 else Shard(0)
        assert p.placements == (want,), ("user fn", name, p.placements)
    _train_and_compare("user function", ref, model, rank)


def _hsdp_case(rank: int) -> None:
    """HSDP 2x1 (two replicas of one shard): ignored embedding and shard_by_dim_1 together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from meshforge.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    ref = _build(QWEN3)
    model = apply_fsdp(
        copy.deepcopy(ref),
        mesh,
        param_dtype=None,
        reduce_dtype=torch.float32,
        ignored_modules=["model.embed_tokens"],
        shard_placement="shard_by_dim_1",
    )
    _check_kinds("hsdp", model, {"model.embed_tokens.weight"})
    assert model.lm_head.weight.placements == (Replicate(), Shard(1))
    _train_and_compare("hsdp", ref, model, rank)


def _worker(rank: int, world: int, save_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    _ignored_cases(mesh, rank)
    _checkpoint_case(mesh, rank, Path(save_dir))
    _meta_and_bf16_cases(mesh, rank)
    _partial_grads_case(mesh, rank)
    _placement_cases(mesh, rank)
    _hsdp_case(rank)


def test_ignored_modules_and_shard_placement_equal_one_process(tmp_path: Path) -> None:
    run_workers(_worker, WORLD, str(tmp_path / "ckpt"))
