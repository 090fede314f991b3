"""Context parallelism on deepseek_v3 (MLA) and gpt_oss (sinks, sliding windows) equals one process (gloo).

One 2-process launch checks, against a single-process model with the same weights, the
full-order logits (gathered back from the ranks), the loss and every parameter gradient
(summed over the CP ranks, as FSDP over the cp mesh would) for each method that runs on
2 ranks (ulysses, colossal with the fused CPU kernel and on its plain autograd path,
kvallgather), with packed documents cut across the rank chunks:

* deepseek_v3 with q LoRA and values narrower than q/k (12 vs 8), and without q LoRA and
  values wider (16 vs 12), interleaved RoPE: CP pads the narrower side and cuts it again;
* gpt_oss with a sliding layer (window 5, crossing every chunk boundary of a 16-token row)
  and a full layer, GQA 4:2 (and MQA under ulysses and the ring), sinks large enough to
  matter.

It also checks the refusals (qwen3_next, attention dropout). A 4-process launch checks
hybrid (ulysses 2 x ring 2) on both families.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests._compare import rel_error
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

SEQ = 16
TOL = 1e-5


def _deepseek(q_lora_rank: int | None, v_head_dim: int, **extra):
    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.deepseek_v3.model import build_deepseek_v3

    args = DeepseekV3Args(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=v_head_dim,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        **extra,
    )
    return lambda: build_deepseek_v3(args, device="cpu")


def _gpt_oss(num_kv_heads: int = 2, **extra):
    from meshforge.models.gpt_oss.args import GptOssArgs
    from meshforge.models.gpt_oss.model import build_gpt_oss

    args = GptOssArgs(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        max_position_embeddings=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        **extra,
    )
    return lambda: build_gpt_oss(args, device="cpu")


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 64, (2, SEQ), generator=g)
    labels = torch.randint(0, 64, (2, SEQ), generator=g)
    batch = {"input_ids": input_ids, "labels": labels}
    if packed:
        # Documents cut across the CP chunks on purpose; row 1 ends in padding (segment 0).
        seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 5 + [0] * 2])
        batch["segment_ids"] = seg
        batch["labels"] = labels.masked_fill(seg == 0, -100)
    return batch


def _reference(build):
    """The model with weights that make every term count: sinks and biases well away from 0."""
    model = build()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias", "norm.weight")):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _check_equal(name: str, build, method: str, mesh, *, packed: bool) -> None:
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp, unshard_sequence

    ref = _reference(build)
    model = build()
    model.load_state_dict(ref.state_dict())
    apply_cp(model, mesh, method=method, ulysses_degree=2 if method == "hybrid" else None)
    batch = _batch(packed)
    tokens = (batch["labels"] != -100).sum()

    ref_logits = ref(batch["input_ids"], None, batch.get("segment_ids"))
    ref_loss = cross_entropy_sum(ref_logits, batch["labels"])
    (ref_loss / tokens).backward()

    local = shard_batch_for_cp(batch, mesh, method=method)
    logits = model(local["input_ids"], local["position_ids"], local.get("segment_ids"))
    loss = cross_entropy_sum(logits, local["labels"])
    (loss / tokens).backward()

    what = f"{name} {method} packed={packed}"
    full = unshard_sequence(logits.detach(), mesh, method=method)
    assert rel_error(full, ref_logits.detach()) <= TOL, (what, rel_error(full, ref_logits.detach()))
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    assert rel_error(total, ref_loss.detach()) <= TOL, (what, total, ref_loss)
    checked = 0
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, (what, pname)
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert rel_error(grad, q.grad) <= TOL, (what, pname, rel_error(grad, q.grad))
        checked += 1
    assert checked > 10, (what, checked)


def _check_errors(mesh) -> None:
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.qwen3_next.model import build_qwen3_next
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    nxt = build_qwen3_next(Qwen3NextArgs(vocab_size=64, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(NotImplementedError, match=r"context_parallel > 1 for qwen3_next: .*Gated DeltaNet"):
        apply_cp(nxt, mesh, method="colossal")
    batch = shard_batch_for_cp(_batch(False), mesh, method="ulysses")
    for build in (_deepseek(8, 8, attention_dropout=0.1), _gpt_oss(attention_dropout=0.1)):
        model = build()
        apply_cp(model, mesh, method="ulysses")
        with pytest.raises(ValueError, match=r"attention_dropout: not supported yet with .*context_parallel"):
            model(batch["input_ids"], batch["position_ids"])


@contextlib.contextmanager
def _plain_ring():
    """The ring's plain autograd path (used off CPU) instead of the fused CPU flash kernel."""
    from meshforge.parallel.context import plan as context

    context.FUSED_CPU_RING = False
    try:
        yield
    finally:
        context.FUSED_CPU_RING = True


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    models = {
        "deepseek_qlora_v8": _deepseek(8, 8),
        "deepseek_v16": _deepseek(None, 16),
        "gpt_oss": _gpt_oss(),
    }
    if world == 2:
        for name, build in models.items():
            for method in ("ulysses", "colossal", "kvallgather"):
                _check_equal(name, build, method, mesh, packed=True)
            with _plain_ring():
                _check_equal(name, build, "colossal", mesh, packed=True)
        for method in ("colossal", "kvallgather"):
            _check_equal("gpt_oss", models["gpt_oss"], method, mesh, packed=False)
        _check_equal("deepseek_qlora_v8", models["deepseek_qlora_v8"], "colossal", mesh, packed=False)
        # MQA: ulysses repeats the one K/V head so each rank gets whole groups.
        for method in ("ulysses", "colossal"):
            _check_equal("gpt_oss_mqa", _gpt_oss(num_kv_heads=1), method, mesh, packed=True)
        _check_errors(mesh)
    else:
        for name in ("deepseek_qlora_v8", "gpt_oss"):
            _check_equal(name, models[name], "hybrid", mesh, packed=True)
        with _plain_ring():
            _check_equal("gpt_oss", models["gpt_oss"], "hybrid", mesh, packed=True)


def _launch(world: int) -> None:
    run_workers(_worker, world)


def test_cp_deepseek_and_gpt_oss_two_ranks_equal_one_process() -> None:
    _launch(2)


def test_cp_deepseek_and_gpt_oss_hybrid_four_ranks_equal_one_process() -> None:
    _launch(4)
