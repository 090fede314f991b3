"""The planner traces one layer per kind: its estimate equals a trace of every layer, byte for byte.

Layers of one kind (same classes, shapes and applied recompute/swap coverage) get the traced
representative's bytes; mixed kinds (Gated DeltaNet and attention, dense and MoE layers, MTP
blocks) and recompute on some layers only must each be traced on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

from meshforge.memory.apply import ActivationSettings
from meshforge.memory.config import RecomputeConfig, SwapConfig
from meshforge.memory.estimate import ActivationEstimate, measure_activations
from tests.unit.test_swap import FAMILIES


def _deepseek_v3_mtp(depths: int) -> nn.Module:
    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.deepseek_v3.model import build_deepseek_v3

    model = FAMILIES["deepseek_v3"]()
    args = DeepseekV3Args(**{**vars(model.args), "num_hidden_layers": 4, "num_nextn_predict_layers": depths})
    return build_deepseek_v3(args, device="cpu")


def _qwen3_deep() -> nn.Module:
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3

    model = FAMILIES["qwen3"]()
    return build_qwen3(Qwen3Args(**{**vars(model.args), "num_hidden_layers": 6}), device="cpu")


def _step3p5() -> nn.Module:
    """The tiny Step-3.5: its MoE block is ``moe`` (not ``mlp``), its shared expert a sibling."""
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config import config_from_dict
    from meshforge.config.loader import read_config_file
    from tests.conftest import REPO

    cfg = config_from_dict(read_config_file(REPO / "configs" / "step3p5" / "tiny.yaml")[0])
    source = resolve_model_source(cfg.model)
    return source.family.build(source.options)


SELECT_SOME = RecomputeConfig(mode="select", select_module={"attention": ["1-2"], "mlp": ["4"]})
FULL_SOME = RecomputeConfig(mode="full", full_recompute_layer=["0-1"])
CASES: dict[str, tuple[Callable[[], nn.Module], ActivationSettings, bool]] = {
    "qwen3_select_some": (_qwen3_deep, ActivationSettings(recompute=SELECT_SOME), False),
    "qwen3_swap_some": (
        _qwen3_deep,
        ActivationSettings(swap=SwapConfig(enable=True, layer_swap=[{"layers": ["3"]}])),
        False,
    ),
    "qwen3_next_mixed": (FAMILIES["qwen3_next"], ActivationSettings(), False),
    "qwen3_next_full_some": (FAMILIES["qwen3_next"], ActivationSettings(recompute=FULL_SOME), False),
    "deepseek_v3_dense_moe_mtp": (
        partial(_deepseek_v3_mtp, 2),
        ActivationSettings(recompute=FULL_SOME),
        True,
    ),
    "generic": (FAMILIES["generic"], ActivationSettings(), False),
    "step3p5_moe_block": (_step3p5, ActivationSettings(), False),
}


def _measure(
    build: Callable[[], nn.Module], settings: ActivationSettings, mtp: bool, **kw: bool
) -> ActivationEstimate:
    return measure_activations(
        build, settings, micro_batch=2, seq=32, dtype=torch.float32, chunk_loss_size=None, mtp=mtp, **kw
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_layer_per_kind_equals_tracing_every_layer(case: str) -> None:
    build, settings, mtp = CASES[case]
    full = _measure(build, settings, mtp, every_layer=True)
    per_kind = _measure(build, settings, mtp)
    assert per_kind.layers == full.layers
    assert per_kind.outside == full.outside
    assert per_kind.notes == full.notes
    assert all(b.device + b.host > 0 for b in full.layers.values()), full.layers


def test_layers_differing_only_in_coverage_are_traced_apart() -> None:
    """Select recompute on layers 1-2 only: those save less than the layers around them."""
    build, settings, _ = CASES["qwen3_select_some"]
    est = _measure(build, settings, False)
    plain = _measure(build, ActivationSettings(), False)
    dev = {i: b.device for i, b in est.layers.items()}
    assert dev[1] == dev[2] < dev[0] == dev[3] == dev[5] == plain.layers[0].device
    assert dev[4] < dev[0] and dev[4] != dev[1]


def test_mtp_blocks_are_measured_when_trained() -> None:
    """Each MTP depth saves a layer's activations and its logits and loss count outside the layers."""
    build = partial(_deepseek_v3_mtp, 1)
    off = _measure(build, ActivationSettings(), False)
    on = _measure(build, ActivationSettings(), True)
    assert off.layers[4] == type(off.layers[4])(0, 0, off.layers[4].formula)
    # The MTP block is a MoE layer with its input projection on top: at least the last decoder layer's.
    assert on.layers[4].device > on.layers[3].device
    assert {i: b for i, b in on.layers.items() if i < 4} == {i: b for i, b in off.layers.items() if i < 4}
    # The depth's logits [2, 32, vocab] in fp32 (and their loss) at least.
    assert on.outside - off.outside >= 2 * 32 * 64 * 4


def test_moe_block_not_named_mlp_traced_with_balanced_routing_within_5_percent() -> None:
    """Step-3.5's routed block (``moe``) runs on fake tensors with balanced routing counts."""
    from meshforge.loss.cross_entropy import cross_entropy_sum
    from meshforge.memory.ledger import SavedTensorLedger

    torch.manual_seed(0)
    with torch.device("meta"):
        model = _step3p5()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        cross_entropy_sum(model(ids), ids)
    estimate = _measure(_step3p5, ActivationSettings(), False)
    assert not any("by formula" in note for note in estimate.notes)
    assert abs(estimate.device_bytes - ledger.device_bytes) <= 0.05 * ledger.device_bytes
