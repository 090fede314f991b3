"""The args rules the families share: the RoPE fields' precedence and the MoE routing checks."""

from __future__ import annotations

import re

import pytest

from meshforge.models.common import arg_rules as rules


def test_rope_base_prefers_rope_parameters_then_the_top_level_key_then_the_default() -> None:
    assert rules.rope_base({"rope_theta": 1e6}, 5e5, default=1e4) == 1e6
    assert rules.rope_base({"rope_type": "default"}, 5e5, default=1e4) == 5e5
    assert rules.rope_base(None, None, default=1e4) == 1e4
    assert rules.rope_base({}, None, default=5e6) == 5e6


def test_rotary_share_prefers_rope_parameters_over_the_fallback() -> None:
    assert rules.rotary_share({"partial_rotary_factor": 0.5}, fallback=0.25) == 0.5
    assert rules.rotary_share({"partial_rotary_factor": None}, fallback=0.25) == 0.25
    assert rules.rotary_share(None, fallback=1.0) == 1.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1], "rope_parameters: must be a mapping"),
        ({"rope_type": "yarn"}, "rope_parameters.rope_type: not supported yet: 'yarn'"),
        ({"type": "linear"}, "rope_parameters.rope_type: not supported yet: 'linear'"),
    ],
)
def test_check_default_rope_refuses_scaling(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        rules.check_default_rope(value)


def test_check_default_rope_accepts_default_and_none() -> None:
    rules.check_default_rope(None)
    rules.check_default_rope({"rope_type": "default", "rope_theta": 1e4})


def test_routing_errors_name_the_family_keys() -> None:
    with pytest.raises(ValueError, match=r"moe_top_k: must be at most moe_num_experts \(4\), got 5"):
        rules.check_routing(5, 4, top_k_key="moe_top_k", experts_key="moe_num_experts")
    with pytest.raises(ValueError, match="router_aux_loss_coef: must be >= 0, got -0.1"):
        rules.check_routing(2, 4, experts_key="num_experts", aux_loss_coef=-0.1)
    rules.check_routing(4, 4, experts_key="num_local_experts", aux_loss_coef=0.0)


def test_layer_indices_refuse_bools_and_out_of_range() -> None:
    with pytest.raises(
        ValueError, match=r"mlp_only_layers\[1\]: must be a layer index in \[0, 1\], got True"
    ):
        rules.check_layer_indices("mlp_only_layers", [0, True], 2)
    with pytest.raises(ValueError, match=r"mlp_only_layers\[0\]: must be a layer index in \[0, 1\], got 2"):
        rules.check_layer_indices("mlp_only_layers", [2], 2)
    with pytest.raises(ValueError, match="mlp_only_layers: must be a list of layer indices"):
        rules.check_layer_indices("mlp_only_layers", 0, 2)


def test_sparse_layer_rule() -> None:
    sparse = [
        rules.is_sparse_layer(i, mlp_only_layers=[0], num_experts=4, decoder_sparse_step=2) for i in range(4)
    ]
    assert sparse == [False, True, False, True]
    assert not rules.is_sparse_layer(1, mlp_only_layers=[], num_experts=0, decoder_sparse_step=1)


def test_kv_heads_and_dropout() -> None:
    with pytest.raises(
        ValueError, match=r"num_key_value_heads: must divide num_attention_heads \(4\), got 3"
    ):
        rules.check_kv_heads(4, 3)
    with pytest.raises(ValueError, match=r"attention_dropout: must be in \[0, 1\), got 1.0"):
        rules.check_attention_dropout(1.0)
    rules.check_kv_heads(4, 2)
    rules.check_attention_dropout(0.0)
