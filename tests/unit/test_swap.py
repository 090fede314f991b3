"""Activation swap in one process: exact numerics, the bytes it moves, the prefetch order, bad keys.

Each family (and the generic transformers path) runs the same forward and backward with and
without swap: the host copies are exact, so the loss and every gradient must be bitwise equal.
The ledger proves the saving: the bytes autograd holds on the device fall by what went to host,
and the host bytes are the bytes the swap reports as moved.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from meshforge.loss.cross_entropy import cross_entropy_sum
from meshforge.memory.config import SwapConfig
from meshforge.memory.ledger import SavedTensorLedger
from meshforge.memory.swap import MIN_SWAP_BYTES, apply_swap, build_swap
from tests._compare import rel_error

VOCAB, ROWS, SEQ = 64, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64)


def _qwen3() -> nn.Module:
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3

    args = Qwen3Args(
        **COMMON,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return build_qwen3(args, device="cpu")


def _qwen3_moe() -> nn.Module:
    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
    from meshforge.models.qwen3_moe.model import build_qwen3_moe

    args = Qwen3MoeArgs(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return build_qwen3_moe(args, device="cpu")


def _deepseek_v3() -> nn.Module:
    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.deepseek_v3.model import build_deepseek_v3

    args = DeepseekV3Args(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_nextn_predict_layers=0,
        num_hidden_layers=3,
        q_lora_rank=24,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    )
    return build_deepseek_v3(args, device="cpu")


def _qwen3_next() -> nn.Module:
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.qwen3_next.model import build_qwen3_next

    # Layers: DeltaNet, attention, DeltaNet, attention; layer 0 dense, the rest MoE.
    args = Qwen3NextArgs(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    )
    return build_qwen3_next(args, device="cpu")


def _generic() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        **COMMON,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return transformers.Qwen2ForCausalLM(config)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "qwen3_next": _qwen3_next,
    "generic": _generic,
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(
        0, VOCAB, (ROWS, SEQ), generator=g
    )


def _step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], SavedTensorLedger]:
    """Loss, gradients (in parameter order) and the ledger of one forward and backward."""
    ids, labels = _batch()
    model.zero_grad(set_to_none=True)
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        out = model(input_ids=ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = cross_entropy_sum(logits, labels)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return loss.detach(), grads, ledger


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def _num_layers(model: nn.Module) -> int:
    return len(model.model.layers)


def _bitwise(ref: tuple, got: tuple) -> None:
    assert torch.equal(ref[0], got[0]), (ref[0].item(), got[0].item())
    assert len(ref[1]) == len(got[1])
    for i, (a, b) in enumerate(zip(ref[1], got[1], strict=True)):
        assert torch.equal(a, b), f"gradient {i} differs"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layer_swap_is_exact_and_moves_the_layers_activations(family: str) -> None:
    model = _model(family)
    n = _num_layers(model)
    ref = _step(model)
    cfg = SwapConfig(enable=True, default_prefetch=1, layer_swap=[{"layers": [f"0-{n - 1}"]}])
    applied, runtime = build_swap(model, cfg, num_layers=n)
    assert applied == {i: [""] for i in range(n)}
    got = _step(model)
    _bitwise(ref, got)
    before, after = ref[2], got[2]
    assert before.host_bytes == 0
    assert after.host_bytes == runtime.take_moved() > 0
    assert runtime.take_moved() == 0  # counted since the last call
    # What left the device went to host: the layers held most of the saved bytes.
    assert after.device_bytes < 0.35 * before.device_bytes, (before, after)
    assert after.device_bytes + after.host_bytes >= before.device_bytes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_op_swap_of_attention_and_mlp_is_exact(family: str) -> None:
    model = _model(family)
    n = _num_layers(model)
    ref = _step(model)
    cfg = SwapConfig(
        enable=True,
        op_swap=[{"op_name": "attention", "layers": [f"0-{n - 1}"]}, {"op_name": "mlp", "layers": ["1"]}],
    )
    applied, runtime = build_swap(model, cfg, num_layers=n)
    assert set(applied) == set(range(n))
    assert len(applied[1]) == 2 and all(len(applied[i]) == 1 for i in applied if i != 1)
    got = _step(model)
    _bitwise(ref, got)
    assert 0 < got[2].host_bytes == runtime.moved
    assert got[2].device_bytes < ref[2].device_bytes


def test_swap_names_resolve_per_layer_kind() -> None:
    """qwen3_next's 'attention' is linear_attn in DeltaNet layers and self_attn in the others."""
    model = _model("qwen3_next")
    cfg = SwapConfig(enable=True, op_swap=[{"op_name": "attention", "layers": ["0-3"]}])
    applied, _ = apply_swap(model, cfg, num_layers=4)
    assert applied == {0: ["linear_attn"], 1: ["self_attn"], 2: ["linear_attn"], 3: ["self_attn"]}
    # transformers' own path names work too, and nested matches wrap the outermost module only.
    model = _model("qwen3")
    cfg = SwapConfig(enable=True, op_swap=[{"op_name": "self_attn.*|self_attn", "layers": ["0"]}])
    assert apply_swap(model, cfg, num_layers=4)[0] == {0: ["self_attn"]}


def test_prefetch_order() -> None:
    """First unpack of layer i: fetch i (unless already fetched), then i-1 .. i-k."""
    model = _model("qwen3")
    cfg = SwapConfig(enable=True, default_prefetch=2, layer_swap=[{"layers": ["0-3"]}])
    _, runtime = build_swap(model, cfg, num_layers=4)
    runtime.trace = []
    _step(model)
    assert runtime.trace == [
        ("use", 3),
        ("fetch", 3),
        ("fetch", 2),
        ("fetch", 1),
        ("use", 2),
        ("fetch", 0),
        ("use", 1),
        ("use", 0),
    ]
    # Two micro-batches forward before either backward (as a pipeline schedule runs them):
    # each backward fetches its own forward's tensors.
    runtime.trace = []
    ids, labels = _batch()
    losses = [cross_entropy_sum(model(input_ids=ids[i : i + 1]), labels[i : i + 1]) for i in range(2)]
    for loss in losses:
        loss.backward()
    want = [
        ("use", 3),
        ("fetch", 3),
        ("fetch", 2),
        ("fetch", 1),
        ("use", 2),
        ("fetch", 0),
        ("use", 1),
        ("use", 0),
    ]
    assert runtime.trace == want + want


def test_only_swapped_layers_move_and_parameters_and_tiny_tensors_stay() -> None:
    model = _model("qwen3")
    ref = _step(model)[2]
    cfg = SwapConfig(enable=True, layer_swap=[{"layers": ["2"]}])
    _, runtime = build_swap(model, cfg, num_layers=4)
    got = _step(model)[2]
    one_layer = runtime.moved
    # One of four identical layers: about a quarter of the layers' bytes, never a parameter.
    assert 0 < one_layer < 0.35 * ref.device_bytes
    assert got.device_bytes + got.host_bytes >= ref.device_bytes
    saw: list[int] = []
    kept: list[bool] = []
    original = runtime._pack

    def spy(layer_pass, tensor):  # type: ignore[no-untyped-def]
        packed = original(layer_pass, tensor)
        if not isinstance(packed, torch.Tensor):
            saw.append(tensor.untyped_storage().nbytes())
        else:
            param_view = isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)
            assert param_view or tensor.untyped_storage().nbytes() < MIN_SWAP_BYTES
            kept.append(param_view)
        return packed

    runtime._pack = spy  # type: ignore[method-assign]
    _step(model)
    assert saw and min(saw) >= MIN_SWAP_BYTES
    assert any(kept) and not all(kept)  # weights (and their views) and tiny tensors both occur


def test_no_grad_forward_is_not_swapped() -> None:
    model = _model("qwen3")
    _, bytes_moved = apply_swap(
        model, SwapConfig(enable=True, layer_swap=[{"layers": ["0-3"]}]), num_layers=4
    )
    with torch.no_grad():
        model(input_ids=_batch()[0])
    assert bytes_moved() == 0


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (
            SwapConfig(enable=True, default_prefetch=4, layer_swap=[{"layers": ["0"]}]),
            "swap.default_prefetch",
        ),
        (
            SwapConfig(enable=True, layer_swap=[{"layers": ["0"]}, {"layers": ["1-4"]}]),
            "swap.layer_swap[1].layers",
        ),
        (SwapConfig(enable=True, op_swap=[{"op_name": "mlp", "layers": ["7"]}]), "swap.op_swap[0].layers"),
        (
            SwapConfig(
                enable=True,
                op_swap=[{"op_name": "mlp", "layers": ["0"]}, {"op_name": "nope", "layers": ["1-2"]}],
            ),
            "swap.op_swap[1].op_name",
        ),
        (SwapConfig(enable=True, op_swap=[{"op_name": "(", "layers": ["0"]}]), "swap.op_swap[0].op_name"),
        (SwapConfig(enable=True), "swap.enable"),
    ],
)
def test_bad_swap_settings_name_the_key(cfg: SwapConfig, key: str) -> None:
    model = _model("qwen3")
    with pytest.raises(ValueError) as info:
        apply_swap(model, cfg, num_layers=4)
    assert str(info.value).startswith(f"{key}: "), str(info.value)


def test_unmatched_op_name_lists_the_layer_and_its_modules() -> None:
    model = _model("qwen3")
    cfg = SwapConfig(enable=True, op_swap=[{"op_name": "attention.nope", "layers": ["1-2"]}])
    with pytest.raises(
        ValueError,
        match=r"swap.op_swap\[0\].op_name: 'attention.nope' matches no submodule of decoder layer\(s\) 1, 2 .*self_attn",
    ):
        apply_swap(model, cfg, num_layers=4)


def test_a_layer_both_swapped_and_fully_recomputed_is_refused_at_load() -> None:
    from meshforge.config import ConfigError, config_from_dict

    def load(swap: dict, full: list[str]) -> None:
        config_from_dict(
            {"recompute": {"mode": "full", "full_recompute_layer": full}, "swap": {"enable": True, **swap}}
        )

    with pytest.raises(ConfigError) as info:
        load({"layer_swap": [{"layers": ["0"]}, {"layers": ["2-3"]}]}, ["1-2"])
    assert [path for path, _ in info.value.issues] == ["swap.layer_swap[1].layers"]
    assert "layer 2 is also in recompute.full_recompute_layer" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load({"op_swap": [{"op_name": "mlp", "layers": ["1"]}]}, ["0-1"])
    assert [path for path, _ in info.value.issues] == ["swap.op_swap[0].layers"]
    load({"layer_swap": [{"layers": ["2-3"]}]}, ["0-1"])  # disjoint layers compose
    select = {"mode": "select", "select_module": {"mlp": ["0-1"]}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"recompute": select, "swap": {"enable": True, "op_swap": [{"op_name": "mlp", "layers": ["1"]}]}}
        )
    assert [path for path, _ in info.value.issues] == ["swap.op_swap[0].op_name"]
    # A recomputed submodule inside a swapped layer composes (tested above with checkpoint).
    config_from_dict({"recompute": select, "swap": {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}})


@pytest.mark.procs  # inductor compiles its C++ kernels in processes
def test_swap_composes_with_compiled_layers() -> None:
    """``kernels.compile`` compiles each layer after swap wrapped it: same numbers, bytes still moved."""
    from meshforge.models.common.kernels import apply_compile

    eager = _model("qwen3")
    ref = _step(eager)
    model = _model("qwen3")
    _, runtime = build_swap(model, SwapConfig(enable=True, layer_swap=[{"layers": ["0-2"]}]), num_layers=4)
    apply_compile(model)
    got = _step(model)
    assert runtime.moved > 0
    # Compiled kernels round differently from eager ones: compared norm-relative, not bitwise.
    assert rel_error(got[0], ref[0]) <= 1e-5
    for a, b in zip(ref[1], got[1], strict=True):
        assert rel_error(b, a) <= 1e-5


def _checkpointed(module: nn.Module, calls: list[int]) -> None:
    """Wrap ``module.forward`` in a non-reentrant checkpoint, counting its runs."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            calls.append(1)
            return inner(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def test_checkpointed_submodule_inside_a_swapped_layer_composes() -> None:
    """Select recompute inside layer swap: the mlp is recomputed, the rest of the layer swapped."""
    model = _model("qwen3")
    ref = _step(model)
    _, runtime = build_swap(model, SwapConfig(enable=True, layer_swap=[{"layers": ["0-3"]}]), num_layers=4)
    swapped_only = _step(model)
    moved_without = runtime.take_moved()
    calls: list[int] = []
    for layer in model.model.layers:
        _checkpointed(layer.mlp, calls)
    got = _step(model)
    _bitwise(ref, got)
    assert len(calls) == 8  # each mlp ran in forward and once more in backward
    # The mlp's internals are recomputed instead of copied: fewer bytes move to host.
    assert 0 < runtime.take_moved() < moved_without
    assert got[2].device_bytes == swapped_only[2].device_bytes


def test_why_a_fully_recomputed_layer_cannot_also_be_swapped() -> None:
    """Swap hooks inside a checkpointed layer hide every tensor from checkpoint: no recompute runs."""
    model = _model("qwen3")
    ref = _step(model)
    build_swap(model, SwapConfig(enable=True, layer_swap=[{"layers": ["0-3"]}]), num_layers=4)
    calls: list[int] = []
    for layer in model.model.layers:
        _checkpointed(layer, calls)
    _bitwise(ref, _step(model))
    assert len(calls) == 4  # forward only: the layers were swapped, never recomputed


def test_swap_nested_inside_a_recomputed_module_leaves_it_to_the_checkpoint() -> None:
    """op_swap of a projection inside a select-recomputed attention: the checkpoint keeps only
    the attention's inputs, so nothing of it moves, and the numbers stay exact."""
    from meshforge.memory.config import RecomputeConfig
    from meshforge.memory.recompute import apply_recompute

    model = _model("qwen3")
    ref = _step(model)
    cfg = SwapConfig(enable=True, op_swap=[{"op_name": "self_attn.q_proj", "layers": ["0-3"]}])
    _, runtime = build_swap(model, cfg, num_layers=4)
    apply_recompute(model, RecomputeConfig(mode="select", select_module={"attention": ["0-3"]}), num_layers=4)
    got = _step(model)
    _bitwise(ref, got)
    assert runtime.take_moved() == 0
    assert got[2].host_bytes == 0
