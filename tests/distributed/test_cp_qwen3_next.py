"""Context parallelism (ulysses) on qwen3_next equals one process (gloo, 2 ranks).

One 2-process launch checks, against a single-process model with the same weights, the
full-order logits (gathered back from the ranks), the loss and every parameter gradient
(summed over the CP ranks, as FSDP over the cp mesh would) for tiny hybrid models (Gated
DeltaNet + gated attention layers), with packed documents cut across the ranks' chunks
and a padded row end:

* MoE with 2 key heads serving 4 value heads, GQA attention (4:2), partial RoPE, a chunk
  size (5) that does not divide the row, so the chunked rule pads and carries state across
  chunks of the full row;
* dense layers with as many value heads as key heads (2:2) and one K/V head (MQA:
  ulysses repeats it), without packing.

It also checks the refusals (colossal, kvallgather; head counts that do not divide by the
CP degree). A second test runs ``meshforge train`` on ``configs/qwen3_next/tiny.yaml``
(shrunk) with ``context_parallel=2`` ulysses on 2 processes, and with tensor parallel 2
(sequence parallel) x CP 2 on 4, and compares their per-step loss, grad norm and aux loss
with a 1-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._compare import rel_error
from tests.conftest import read_metrics, write_corpus
from tests.distributed._layouts import train_one
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

SEQ = 16
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


def _args(**extra):
    from meshforge.models.qwen3_next.args import Qwen3NextArgs

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    )
    fields.update(extra)
    return Qwen3NextArgs(**fields)


def _build(args, chunk_size: int, dtype: torch.dtype = torch.float32):
    from meshforge.models.qwen3_next.gdn import GatedDeltaNet
    from meshforge.models.qwen3_next.model import build_qwen3_next

    def build():
        model = build_qwen3_next(args, device="cpu").to(dtype)
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                module.chunk_size = chunk_size
        return model

    return build


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 64, (2, SEQ), generator=g)
    labels = torch.randint(0, 64, (2, SEQ), generator=g)
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        # Documents cut across the CP chunks (8 tokens each) on purpose; row 1 ends in padding.
        seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 5 + [0] * 2])
        batch["segment_ids"] = seg
        batch["labels"] = labels.masked_fill(seg == 0, -100)
    return batch


def _reference(build):
    """The model with weights that make every term count: norms, biases and decays off their init."""
    model = build()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "A_log", "conv1d.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _check_equal(name: str, build, mesh, *, packed: bool, tol: float = TOL) -> None:
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.models.common.moe import set_aux_reduce_group
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp, unshard_sequence

    ref = _reference(build)
    model = build()
    model.load_state_dict(ref.state_dict())
    apply_cp(model, mesh, method="ulysses")
    set_aux_reduce_group(model, mesh)
    batch = _batch(packed)
    tokens = (batch["labels"] != -100).sum()

    ref_logits = ref(batch["input_ids"], None, batch.get("segment_ids"))
    ref_loss = cross_entropy_sum(ref_logits, batch["labels"])
    ref_aux = ref.aux_loss()  # None without MoE layers
    (ref_loss / tokens + (0 if ref_aux is None else ref_aux)).backward()

    local = shard_batch_for_cp(batch, mesh, method="ulysses")
    logits = model(local["input_ids"], local["position_ids"], local.get("segment_ids"))
    loss = cross_entropy_sum(logits, local["labels"])
    aux = model.aux_loss()
    # Every rank holds the same full aux loss; each contributes 1/cp of its gradient.
    (loss / tokens + (0 if aux is None else aux / mesh.size())).backward()

    what = f"{name} packed={packed}"
    full = unshard_sequence(logits.detach(), mesh, method="ulysses")
    assert rel_error(full, ref_logits.detach()) <= tol, (what, rel_error(full, ref_logits.detach()))
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    assert rel_error(total, ref_loss.detach()) <= tol, (what, total, ref_loss)
    assert (aux is None) == (ref_aux is None), what
    if aux is not None:
        assert rel_error(aux.detach(), ref_aux.detach()) <= tol, (what, aux, ref_aux)
    checked = 0
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, (what, pname)
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert rel_error(grad, q.grad) <= tol, (what, pname, rel_error(grad, q.grad))
        checked += 1
    # Every DeltaNet parameter took part (conv channels, decays, gated norm, projections).
    names = {n for n, p in ref.named_parameters() if p.grad is not None}
    for suffix in ("conv1d.weight", "A_log", "dt_bias", "linear_attn.norm.weight", "in_proj_ba.weight"):
        assert any(n.endswith(suffix) for n in names), (what, suffix)
    assert checked > 20, (what, checked)


def _check_errors(mesh) -> None:
    from meshforge.models.qwen3_next.model import build_qwen3_next
    from meshforge.parallel.context import apply_cp

    for method in ("colossal", "kvallgather"):
        with pytest.raises(
            NotImplementedError,
            match=rf"context_parallel > 1 for qwen3_next: context_parallel_method {method}: .*Gated DeltaNet"
            r".*use context_parallel_method ulysses",
        ):
            apply_cp(build_qwen3_next(_args()), mesh, method=method)
    bad_heads = _args(linear_num_key_heads=1, linear_num_value_heads=3)
    with pytest.raises(
        ValueError, match=r"parallelism\.context_parallel: .*model\.linear_num_key_heads must divide by 2"
    ):
        apply_cp(build_qwen3_next(bad_heads), mesh, method="ulysses")


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    _check_equal("moe_gqa", _build(_args(), chunk_size=5), mesh, packed=True)
    dense = _args(
        linear_num_value_heads=2,
        num_key_value_heads=1,
        mlp_only_layers=[0, 1, 2],
        output_router_logits=False,
    )
    # float64 parameters and activations (the rule itself runs in float32 by design): in
    # float32 this model's one-process decay gradients (dt_bias, A_log) are ~5e-6 off their
    # float64 values (sums over tokens that nearly cancel), too close to the tolerance.
    for packed in (False, True):
        _check_equal("dense_mqa", _build(dense, chunk_size=4, dtype=torch.float64), mesh, packed=packed)
    _check_errors(mesh)


def test_cp_ulysses_qwen3_next_two_ranks_equal_one_process() -> None:
    run_workers(_worker, 2)


# configs/qwen3_next/tiny.yaml shrunk to seconds: 2 DeltaNet layers (4 key / 8 value heads) and
# one gated attention layer, MoE (router aux loss on), 3 steps.
_TRAIN = [
    "--training.steps=3",
    "--training.log_interval=1",
    "--training.local_batch_size=2",
    "--training.global_batch_size=4",
    "--train_dataset.dataloader.seq_length=32",
    "--model.hidden_size=32",
    "--model.intermediate_size=48",
    "--model.num_hidden_layers=3",
    "--model.full_attention_interval=3",
    "--model.head_dim=8",
    "--model.linear_key_head_dim=8",
    "--model.linear_value_head_dim=8",
    "--model.moe_intermediate_size=16",
    "--model.shared_expert_intermediate_size=16",
    "--model.num_experts=4",
    "--model.linear_num_key_heads=4",
    "--model.linear_num_value_heads=8",
    "--kernels.gdn_chunk_size=8",
    "--checkpoint.enable_save=false",
    "--lr_scheduler.warmup_steps=0",  # full learning rate from step 1: steps 2-3 see moved weights
]


def test_train_qwen3_next_cp2_ulysses_equals_one_process(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    config = ROOT / "configs" / "qwen3_next" / "tiny.yaml"
    common = [*_TRAIN, f"--train_dataset.dataloader.data_path={corpus}"]
    cp2 = ["--parallelism.context_parallel=2", "--parallelism.context_parallel_method=ulysses"]
    tp2 = ["--parallelism.tensor_parallel=2", "--parallelism.sequence_parallel=true"]
    runs = {}
    # tp2 x cp2: 2 local key heads (1 per CP rank) and 2 local attention heads over 1 K/V head.
    pp2 = [
        "--parallelism.pipeline_parallel=2",
        "--parallelism.pipeline_parallel_schedule=gpipe",
        '--parallelism.pipeline_parallel_layers_per_stage=["0-1","2"]',
    ]
    layouts = (("one", 1, []), ("cp2", 2, cp2), ("tp2_cp2", 4, [*tp2, *cp2]), ("pp2_cp2", 4, [*pp2, *cp2]))
    for name, nproc, extra in layouts:
        out = tmp_path / name
        proc = train_one(config, [*common, *extra, f"--training.output_dir={out}"], nproc=nproc, cwd=tmp_path)
        if nproc > 1:
            assert "CP (ulysses) over 2 ranks" in proc.stdout, proc.stdout
        runs[name] = [m for m in read_metrics(out) if "loss" in m]
    assert "aux_loss" in runs["one"][0], runs["one"][0]
    for name in ("cp2", "tp2_cp2", "pp2_cp2"):
        assert len(runs[name]) == len(runs["one"]) == 3, runs
        for a, b in zip(runs[name], runs["one"], strict=True):
            for key in ("loss", "grad_norm", "aux_loss"):
                assert key in a, (name, key, a)
                assert abs(a[key] - b[key]) <= TOL * abs(b[key]), (name, key, a, b)
