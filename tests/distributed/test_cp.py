"""Context parallelism (ulysses, colossal ring, kvallgather, hybrid) equals one process (gloo).

One 2-process launch runs every check against a single-process model with the same weights:
full-order logits (gathered back from the ranks), the loss and every parameter gradient
(summed over the CP ranks, as FSDP over the cp mesh would) of a tiny GQA Qwen3, with and
without packed documents (the ring both with the fused CPU flash kernel and on its plain
autograd path), plus MQA under ulysses and the ring, qwen3_moe under the ring, and the
error cases.
A 4-process launch checks hybrid (ulysses 2 x ring 2) and colossal with 4 ranks, and
`meshforge train` with cp2 (ulysses, colossal) and tp2+cp2 gives the 1-process losses and
grad norms.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._compare import rel_error
from tests.conftest import read_metrics
from tests.distributed._layouts import Run, train_all
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow

SEQ = 16
TOL = 1e-5


def _args(num_heads: int = 4, num_kv_heads: int = 2):
    from meshforge.models.qwen3.args import Qwen3Args

    return Qwen3Args(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=10_000.0,
    )


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
    )


def _check_equal(method: str, mesh, *, packed: bool, args=None, derive_positions: bool = False) -> None:
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.models.qwen3.model import build_qwen3
    from meshforge.models.qwen3_moe.model import build_qwen3_moe
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp, unshard_sequence

    args = args or _args()
    build = build_qwen3_moe if hasattr(args, "num_experts") else build_qwen3
    ref = build(args, device="cpu")
    model = build(args, device="cpu")
    apply_cp(model, mesh, method=method, ulysses_degree=2 if method == "hybrid" else None)
    batch = _batch(packed)
    tokens = (batch["labels"] != -100).sum()

    ref_logits = ref(batch["input_ids"], None, batch.get("segment_ids"))
    ref_loss = cross_entropy_sum(ref_logits, batch["labels"])
    (ref_loss / tokens).backward()

    local = shard_batch_for_cp(batch, mesh, method=method)
    assert local["input_ids"].shape == (2, SEQ // mesh.size())
    positions = None if derive_positions else local["position_ids"]
    logits = model(local["input_ids"], positions, local.get("segment_ids"))
    loss = cross_entropy_sum(logits, local["labels"])
    (loss / tokens).backward()

    what = f"{method} packed={packed} heads={args.num_attention_heads}/{args.num_key_value_heads}"
    full = unshard_sequence(logits.detach(), mesh, method=method)
    assert rel_error(full, ref_logits.detach()) <= TOL, (what, rel_error(full, ref_logits.detach()))
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    assert rel_error(total, ref_loss.detach()) <= TOL, (what, total, ref_loss)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        assert rel_error(grad, q.grad) <= TOL, (what, name, rel_error(grad, q.grad))


def _check_errors(mesh) -> None:
    from meshforge.models.qwen3.model import build_qwen3
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.qwen3_next.model import build_qwen3_next
    from meshforge.parallel.context import apply_cp, shard_batch_for_cp

    bad = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "labels": torch.zeros(1, 6, dtype=torch.long)}
    with pytest.raises(
        ValueError, match=r"parallelism\.context_parallel: 2 .* seq length is 6.*multiple of 4"
    ):
        shard_batch_for_cp(bad, mesh, method="ring")
    odd = {"input_ids": torch.zeros(1, 7, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"seq length is 7.*multiple of 2"):
        shard_batch_for_cp(odd, mesh, method="ulysses")
    with pytest.raises(ValueError, match=r"num_attention_heads must divide by 2"):
        apply_cp(build_qwen3(_args(3, 1)), mesh, method="ulysses")
    with pytest.raises(ValueError, match=r"ulysses_degree_in_cp"):
        apply_cp(build_qwen3(_args()), mesh, method="hybrid", ulysses_degree=2)
    with pytest.raises(ValueError, match=r"context_parallel_method: unknown 'zigzag'"):
        apply_cp(build_qwen3(_args()), mesh, method="zigzag")
    nxt = build_qwen3_next(Qwen3NextArgs(vocab_size=64, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(
        NotImplementedError, match=r"not supported yet: parallelism.context_parallel > 1 for qwen3_next"
    ):
        apply_cp(nxt, mesh, method="colossal")  # only ulysses runs the Gated DeltaNet
    # A tensor mask (e.g. a stage forward that built its own) is refused, not silently misused.
    model = build_qwen3(_args(), device="cpu")
    apply_cp(model, mesh, method="colossal")
    layer = model.model.layers[0]
    rope = model.model.rotary_emb(None, seq_len=4, device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(TypeError, match="CPMask"):
        layer(torch.zeros(1, 4, 32), rope, None)


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
    if world == 2:
        for method in ("ulysses", "colossal", "kvallgather"):
            for packed in (False, True):
                _check_equal(method, mesh, packed=packed, derive_positions=packed and method != "ulysses")
        _check_equal("colossal", mesh, packed=True, args=_args(4, 1))
        with _plain_ring():
            for packed in (False, True):
                _check_equal("colossal", mesh, packed=packed)
        # MQA: one K/V head repeated so each ulysses rank gets whole groups.
        _check_equal("ulysses", mesh, packed=True, args=_args(4, 1))
        # The MoE family: DecoderModel's token mask (padding out of routing stats) under CP.
        _check_equal("colossal", mesh, packed=True, args=_moe_args())
        _check_errors(mesh)
    else:
        for packed in (False, True):
            _check_equal("hybrid", mesh, packed=packed)
            _check_equal("colossal", mesh, packed=packed)
        with _plain_ring():
            _check_equal("hybrid", mesh, packed=True)


def _launch(world: int) -> None:
    run_workers(_worker, world)


def test_cp_two_ranks_equal_one_process() -> None:
    _launch(2)


def test_cp_four_ranks_hybrid_and_ring_equal_one_process() -> None:
    _launch(4)


def test_train_cp_layouts_equal_one_process(tiny_config: Path, tmp_path: Path) -> None:
    common = ["--training.steps=3", "--checkpoint.enable_save=false"]
    tp2 = ["--parallelism.tensor_parallel=2", "--parallelism.sequence_parallel=true"]
    # ulysses also runs each decoder layer on one row at a time (chunked micro-batches; the CP
    # mask is sliced by rows).
    chunked = ["--parallelism.enable_chunk_batch=true", "--parallelism.chunk_mbs=2"]
    layouts = {"ulysses": (chunked, 2), "colossal": ([], 2), "tp2_colossal": (tp2, 4)}
    # One process here, the 2-rank layouts in one spawn, the 4-rank one in another.
    runs = [Run(tiny_config, [*common, f"--training.output_dir={tmp_path / 'one'}"])]
    for name, (extra, nproc) in layouts.items():
        method = name.rsplit("_", 1)[-1]
        cp = ["--parallelism.context_parallel=2", f"--parallelism.context_parallel_method={method}"]
        overrides = [*common, *extra, f"--training.output_dir={tmp_path / name}", *cp]
        runs.append(Run(tiny_config, overrides, nproc, log=tmp_path / f"{name}.log"))
    train_all(runs)
    one = read_metrics(tmp_path / "one")
    assert len(one) == 3
    for name in layouts:
        method = name.rsplit("_", 1)[-1]
        assert f"CP ({method}) over 2 ranks" in (tmp_path / f"{name}.log").read_text()
        for x, y in zip(one, read_metrics(tmp_path / name), strict=True):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), name
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), name
