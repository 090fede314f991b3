"""Expert parallelism (all-to-all token dispatch) and expert-FSDP equal one process.

Module level (spawned gloo processes, meshes from `ParallelDims.build_mesh` as the trainer
builds them): the EP model and the single-process model get the same seeded weights; each
rank feeds its rows of one global batch; logits, cross-entropy, router aux loss and every
gradient (full tensors) must match the single-process model run on those rows as
micro-batches, with the trainer's objective `CE_sum / global_tokens + coef * aux / ranks`.
That also proves the gradient scaling: no 1/ep factor anywhere.

Trainer level: `meshforge train` with `parallelism.expert_parallel` against one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._compare import rel_error
from tests.conftest import REPO, read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

SEED = 1234
AUX_COEF = 0.1
BATCH, SEQ = 2, 16


def _args(family: str):
    if family == "qwen3_moe":
        from meshforge.models.qwen3_moe.args import Qwen3MoeArgs

        return Qwen3MoeArgs(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            output_router_logits=True,
            tie_word_embeddings=False,
        )
    if family == "deepseek_v3":
        from meshforge.models.deepseek_v3.args import DeepseekV3Args

        return DeepseekV3Args(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            num_nextn_predict_layers=0,
        )
    if family == "qwen3_next":
        import dataclasses

        from meshforge.models.qwen3_next.args import FLAVORS

        # One Gated DeltaNet layer and one attention layer, both sparse.
        return dataclasses.replace(FLAVORS["debug"], vocab_size=96, mlp_only_layers=[])
    from meshforge.models.gpt_oss.args import GptOssArgs

    return GptOssArgs(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )


def _build(family: str):
    import importlib

    module = importlib.import_module(f"meshforge.models.{family}.model")
    return getattr(module, f"build_{family}")(_args(family), device="meta")


def _materialize(model) -> None:
    from meshforge.models.materialize import materialize_and_init

    materialize_and_init(model, device=torch.device("cpu"), seed=SEED, init_fn=model.init_full_parameter_)


def _batch(world: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, vocab, (world * BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (world * BATCH, SEQ), generator=gen)
    return ids, labels


def _objective(model, ids, labels, world):
    logits = model(ids)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    aux = model.aux_loss() if callable(getattr(model, "aux_loss", None)) else None
    objective = ce / labels.numel() / world
    if aux is not None:
        objective = objective + AUX_COEF * aux / world
    return logits, ce, aux, objective


def _full_grad(param: torch.Tensor, *, reduce_plain: bool) -> torch.Tensor:
    """The full gradient of `param` on every rank (a collective: every rank calls it in order)."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if grad is None:
        grad = torch.zeros_like(param)
    if isinstance(grad, DTensor):
        return grad.full_tensor()
    grad = grad.clone()
    if reduce_plain:  # replicated dense parameters without FSDP: sum the ranks' gradients
        dist.all_reduce(grad)
    return grad


def _check_model(family: str, layout: str, errors: list[str], tol: float = 1e-5) -> None:
    """EP (and FSDP) model on this rank against the single-process model on the same rows."""
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import apply_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _build(family)
    _materialize(reference)
    model = _build(family)
    dims = ParallelDims(world_size=world, dp_shard=world, ep=2)
    mesh = dims.build_mesh("cpu")
    apply_ep(model, dims.mesh_for(mesh, "ep"))
    fsdp = layout != "ep"
    if fsdp:
        apply_fsdp(
            model,
            dims.mesh_for(mesh, "fsdp"),
            expert_mesh=dims.mesh_for(mesh, "efsdp"),
            param_dtype=None,
            reduce_dtype=torch.float32,
        )
    _materialize(model)

    ids, labels = _batch(world, reference.args.vocab_size)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    mine = None
    for r in range(world):  # the single process runs every rank's rows as micro-batches
        part = slice(r * BATCH, (r + 1) * BATCH)
        logits, ce, aux, objective = _objective(reference, ids[part], labels[part], world)
        objective.backward()
        if r == rank:
            mine = (logits.detach(), ce.detach(), None if aux is None else aux.detach())
    logits, ce, aux, objective = _objective(model, ids[rows], labels[rows], world)
    objective.backward()

    tag = f"{family}/{layout}/rank{rank}"
    assert mine is not None
    if rel_error(logits.detach(), mine[0]) > tol:
        errors.append(f"{tag}: logits differ by {rel_error(logits.detach(), mine[0]):.2e}")
    if rel_error(ce.detach(), mine[1]) > tol:
        errors.append(f"{tag}: cross-entropy differs by {rel_error(ce.detach(), mine[1]):.2e}")
    if (aux is None) != (mine[2] is None) or (aux is not None and rel_error(aux.detach(), mine[2]) > tol):
        errors.append(f"{tag}: aux loss {aux} vs {mine[2]}")
    ref_params = dict(reference.named_parameters())
    experts_seen = 0
    for name, param in model.named_parameters():
        grad = _full_grad(param, reduce_plain=not fsdp)
        if ".experts." in name:
            experts_seen += 1
            if tuple(param.to_local().shape) == tuple(param.shape):
                errors.append(f"{tag}: {name} is not sharded ({tuple(param.shape)})")
        expected = ref_params[name].grad
        if expected is None:  # no gradient at all (deepseek's score-correction bias)
            if grad.abs().max() > 0:
                errors.append(f"{tag}: {name} got a gradient; one process gives none")
        elif rel_error(grad, expected) > tol:
            errors.append(f"{tag}: gradient of {name} differs by {rel_error(grad, expected):.2e}")
    if not experts_seen:
        errors.append(f"{tag}: no expert parameters found")


def _check_exchange_zero_rows(errors: list[str]) -> None:
    """4 ranks, ep 2 x efsdp 2: a rank whose experts receive no token still joins every collective.

    Ranks 0 and 1 (one ep group) route all their tokens to experts 0 and 1 (held by rank 0),
    so rank 1 receives nothing, while rank 3 (same experts as rank 1, other group) does: the
    expert-FSDP reduce-scatter of experts 2 and 3 must still pair ranks 1 and 3 correctly.
    Then rank 2 has no token of its own while the others send it rows.
    """
    from torch.distributed.fsdp import fully_shard

    from meshforge.models.common.moe import GroupedExperts
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import _expert_placement_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(world_size=world, dp_shard=world, ep=2)
    mesh = dims.build_mesh("cpu")
    efsdp = dims.mesh_for(mesh, "efsdp")
    num_experts, hidden, width, n = 4, 8, 6, 5

    def full_experts() -> GroupedExperts:
        experts = GroupedExperts(num_experts, hidden, width)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        return experts

    gen = torch.Generator().manual_seed(11)
    # Scenario 1 (see the docstring): ranks 0 and 1 only pick experts 0 and 1; ranks 2 and 3 pick any.
    pairs = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    firsts = [torch.randint(0, num_experts, (n, 1), generator=gen) for _ in range(2)]
    skewed = [pairs, pairs] + [torch.cat([i, (i + 1) % num_experts], 1) for i in firsts]
    # Scenario 2: rank 2 has no token at all but owns experts that the others pick.
    firsts = [torch.randint(0, num_experts, (m, 1), generator=gen) for m in (n, n, 0, n)]
    empty_rank = [torch.cat([i, (i + 1) % num_experts], 1) for i in firsts]
    for scenario, indices in (("no rows in", skewed), ("no tokens on rank 2", empty_rank)):
        sharded = full_experts()
        apply_ep(sharded, dims.mesh_for(mesh, "ep"))
        fully_shard(sharded, mesh=efsdp, shard_placement_fn=_expert_placement_fn(efsdp))
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)
        reference = full_experts()
        xs = [torch.randn(i.shape[0], hidden, generator=gen) for i in indices]
        weights = [torch.rand(i.shape[0], 2, generator=gen) for i in indices]
        total = torch.zeros(())
        expected = None
        for r in range(world):
            counts = torch.bincount(indices[r].flatten(), minlength=num_experts)
            out = reference(xs[r], indices[r], weights[r], counts)
            total = total + (out * torch.arange(hidden)).sum()
            if r == rank:
                expected = out.detach()
        total.backward()
        x = xs[rank].clone().requires_grad_(True)
        counts = torch.bincount(indices[rank].flatten(), minlength=num_experts)
        out = sharded(x, indices[rank], weights[rank], counts)
        (out * torch.arange(hidden)).sum().backward()
        tag = f"exchange ({scenario})/rank{rank}"
        if out.shape != expected.shape or (out.numel() and rel_error(out.detach(), expected) > 1e-5):
            errors.append(f"{tag}: outputs differ")
        for name, param in sharded.named_parameters():
            if param.grad is None:
                errors.append(f"{tag}: {name} has no gradient")
                continue
            got = param.grad.full_tensor()
            if rel_error(got, reference.get_parameter(name).grad) > 1e-5:
                errors.append(f"{tag}: gradient of {name} differs")


def _check_errors(errors: list[str]) -> None:
    """Refusals name the key to change (2 ranks)."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3
    from meshforge.models.qwen3_moe.model import build_qwen3_moe
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import apply_fsdp

    ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep_check",))
    odd = build_qwen3_moe(dataclasses.replace(_args("qwen3_moe"), num_experts=3), device="meta")
    dense = build_qwen3(Qwen3Args(vocab_size=96, hidden_size=32, intermediate_size=48), device="meta")
    cases = [
        (
            lambda: apply_ep(odd, ep_mesh),
            ValueError,
            "parallelism.expert_parallel: 2 does not divide model.num_experts = 3",
        ),
        (
            lambda: apply_ep(dense, ep_mesh),
            ValueError,
            "parallelism.expert_parallel: 2 needs a mixture-of-experts",
        ),
        (lambda: apply_ep(torch.nn.Linear(2, 2), ep_mesh), NotImplementedError, "for transformers models"),
        (
            lambda: apply_ep(_build("qwen3_moe"), ep_mesh, token_dispatcher="allgather"),
            NotImplementedError,
            "moe_token_dispatcher_type='allgather'",
        ),
        (
            lambda: apply_ep(_build("qwen3_moe"), ep_mesh, dispatcher="mc2"),
            NotImplementedError,
            "ep_dispatcher='mc2'",
        ),
    ]
    cases.append(
        (
            lambda: apply_ep(_build("qwen3_moe"), ep_mesh, modules=["model.layers.{*}.mlp"]),
            ValueError,
            "parallelism.ep_modules: model.layers.0.mlp",
        )
    )
    # parallelism.ep_modules picks the containers: only layer 1's experts are sharded.
    from meshforge.parallel.expert import expert_modules, is_expert_parallel

    chosen = _build("qwen3_moe")
    apply_ep(chosen, ep_mesh, modules=["model.layers.1.mlp.experts"])
    assert [(n, is_expert_parallel(m)) for n, m in expert_modules(chosen)] == [
        ("model.layers.0.mlp.experts", False),
        ("model.layers.1.mlp.experts", True),
    ]
    sharded = _build("qwen3_moe")
    apply_ep(sharded, ep_mesh)
    fsdp_args = {"param_dtype": None, "reduce_dtype": torch.float32}
    cases.append((lambda: apply_fsdp(sharded, ep_mesh, **fsdp_args), ValueError, "pass expert_mesh"))
    cases.append(
        (
            lambda: apply_fsdp(_build("qwen3_moe"), ep_mesh, expert_mesh=ep_mesh, **fsdp_args),
            ValueError,
            "no experts",
        )
    )
    for call, kind, text in cases:
        try:
            call()
        except kind as error:
            if text not in str(error):
                errors.append(f"errors: {text!r} not in {error}")
        else:
            errors.append(f"errors: no {kind.__name__} for {text!r}")


def _check_hf_roundtrip(folder: Path, errors: list[str]) -> None:
    """HF safetensors load into EP x expert-FSDP shards (each rank its experts) and export back."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshforge.checkpoint import hf
    from meshforge.models.materialize import materialize_and_init
    from meshforge.models.registry import resolve_family
    from meshforge.parallel.dims import ParallelDims
    from meshforge.parallel.expert import apply_ep
    from meshforge.parallel.fsdp import apply_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    family = resolve_family("qwen3_moe")
    reference = _build("qwen3_moe")
    _materialize(reference)
    hf.save_hf(reference, family, folder / "source")  # rank 0 writes (per-expert keys), all wait

    model = _build("qwen3_moe")
    dims = ParallelDims(world_size=world, dp_shard=world, ep=2)
    mesh = dims.build_mesh("cpu")
    apply_ep(model, dims.mesh_for(mesh, "ep"))
    apply_fsdp(
        model,
        dims.mesh_for(mesh, "fsdp"),
        expert_mesh=dims.mesh_for(mesh, "efsdp"),
        param_dtype=None,
        reduce_dtype=torch.float32,
    )
    materialize_and_init(model, device=torch.device("cpu"), seed=0, init_fn=lambda *_: None)
    hf.load_hf_weights(model, family, folder / "source")
    experts = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    want = reference.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    ep_rank, efsdp_rank = (
        dims.mesh_for(mesh, "ep").get_local_rank(),
        dims.mesh_for(mesh, "efsdp").get_local_rank(),
    )
    rows = want.shape[1] // 2
    mine = want[2 * ep_rank : 2 * ep_rank + 2, efsdp_rank * rows : (efsdp_rank + 1) * rows]
    if not torch.equal(experts.to_local(), mine):  # experts 2r, 2r+1; dim 1 halved by expert-FSDP
        errors.append(f"hf/rank{rank}: local expert shard is not experts {2 * ep_rank}-{2 * ep_rank + 1}")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, tensor in reference.state_dict().items() if rank == 0 else ():  # rank 0 holds the gather
        if not torch.equal(full[name], tensor):
            errors.append(f"hf/rank{rank}: loaded {name} differs")
    hf.save_hf(model, family, folder / "export")
    if rank == 0:
        source = load_file(str(folder / "source" / "model.safetensors"))
        export = load_file(str(folder / "export" / "model.safetensors"))
        if source.keys() != export.keys() or any(not torch.equal(export[k], v) for k, v in source.items()):
            errors.append("hf: the export from EP shards differs from the loaded checkpoint")


def _worker(rank: int, world: int, folder: str) -> None:
    errors: list[str] = []
    if world == 2:
        _check_errors(errors)
        _check_model("qwen3_moe", "ep", errors)
        _check_model("qwen3_moe", "ep+fsdp", errors)
        _check_model("deepseek_v3", "ep+fsdp", errors)
        _check_model("gpt_oss", "ep+fsdp", errors)
        _check_model("qwen3_next", "ep+fsdp", errors)
    else:
        _check_model("qwen3_moe", "dp4 ep2 efsdp2", errors)
        _check_exchange_zero_rows(errors)
        _check_hf_roundtrip(Path(folder), errors)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_module_equals_one_process(world: int, tmp_path: Path) -> None:
    run_workers(_worker, world, str(tmp_path))


TRAIN = [
    "--training.steps=5",
    "--training.deterministic=true",
    "--training.local_batch_size=2",  # the same micro-batches (and router aux losses) in every layout
    "--training.log_interval=1",
    "--model.num_hidden_layers=2",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.moe_intermediate_size=32",
    "--model.num_experts=4",
    "--model.head_dim=16",
    "--train_dataset.dataloader.seq_length=32",
    "--lr_scheduler.warmup_steps=1",
    "--lr_scheduler.learning_rate=1.e-2",
]


def _assert_same_steps(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)


def test_trainer_ep_equals_one_process_and_resumes_elsewhere(tmp_path: Path) -> None:
    """qwen3_moe: ep2 on 2 ranks, dp4 + ep2 + expert-FSDP 2 and dp4 + ep2 with replicated expert
    shards (ep_fsdp_size 1), and dp2 x tp2 x ep2 with the deduplicated dispatch on 4 ranks equal
    one process step by step; the 4-rank checkpoint continues in one process with the same loss.

    The one-process runs train in this process, the 2-rank and the 4-rank layouts in one spawn each.
    """
    config = REPO / "configs" / "qwen3_moe" / "tiny.yaml"
    out = {
        name: tmp_path / name
        for name in ("one", "ep2", "ep2_layer1", "ep2x2", "ep2_replicated", "ep2_tp2_dedup", "resumed")
    }
    no_save = "--checkpoint.enable_save=false"
    ep = "--parallelism.expert_parallel=2"
    # parallelism.ep_modules: only the second layer's experts over EP; the first stays whole
    # (sharded by FSDP with its layer).
    layer1 = [
        "--parallelism.ep_modules=['model.layers.1.mlp.experts']",
        "--parallelism.ep_fsdp_modules=['model.layers.1.mlp.experts']",
    ]
    save = "--checkpoint.save_interleaved_steps=4"
    # parallelism.ep_fsdp_size 1 (MindSpeed's value): each expert replicated over the two
    # ranks outside its expert group (a 2 x 1 HSDP mesh for the experts).
    # Also dense_fsdp_shard_size 2 (MindFormers): dense weights sharded over pairs, 2 replicas.
    fsdp1 = ["--parallelism.ep_fsdp_size=1", "--parallelism.dense_fsdp_shard_size=2"]
    # EP with TP (dp2 x tp2, experts over ep2 at each TP coordinate) and the deduplicated dispatch.
    ep_tp_args = [
        "--parallelism.tensor_parallel=2",
        "--parallelism.moe_token_dispatcher_type=alltoall_deredundancy",
        "--parallelism.npu_nums_per_device=2",
    ]
    step4 = out["ep2x2"] / "checkpoints" / "checkpoint-00000004"

    def run(name: str, extra: list[str], nproc: int = 1, *, log: bool = False) -> Run:
        overrides = [*TRAIN, *extra, f"--training.output_dir={out[name]}"]
        return Run(config, overrides, nproc, log=out[name].with_suffix(".log") if log else None)

    train_all(
        [
            run("one", [no_save]),
            run("ep2", [ep, no_save], 2, log=True),
            run("ep2_layer1", [ep, *layer1, no_save], 2),
            run("ep2x2", [ep, save], 4),
            run("ep2_replicated", [ep, *fsdp1, no_save], 4, log=True),
            run("ep2_tp2_dedup", [ep, *ep_tp_args, no_save], 4),
            run("resumed", [no_save, f"--checkpoint.load_path={step4}"]),
        ]
    )
    assert "experts over 2 ranks" in out["ep2"].with_suffix(".log").read_text()
    replicated_log = out["ep2_replicated"].with_suffix(".log").read_text()
    assert "experts over 2 ranks (expert-FSDP over 1 x 2 replicas)" in replicated_log
    assert "HSDP: 2 replicas x FSDP over 2 ranks" in replicated_log
    one = read_metrics(out["one"])
    assert len(one) == 5 and one[-1]["loss"] < one[0]["loss"] - 0.1  # it trains
    for name in ("ep2_tp2_dedup", "ep2_layer1", "ep2", "ep2x2", "ep2_replicated"):
        _assert_same_steps(one, read_metrics(out[name]))
    _assert_same_steps(one[4:], read_metrics(out["resumed"]))
