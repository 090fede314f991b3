"""DeepSeek-V3 with YaRN RoPE against transformers: frequencies, the cos/sin gain, the
``mscale_all_dim`` softmax-scale correction, logits and loss past the original context."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from meshforge.models.deepseek_v3.args import from_options
from meshforge.models.deepseek_v3.hf import from_hf_config
from tests.unit._parity import rel
from tests.unit.test_deepseek_v3 import CONFIGS, _pair

transformers = pytest.importorskip("transformers")

# Short original context so a 40-token row crosses the interpolated band.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize("name", ["qlora_groups_untied", "plain_q_tied_halfrope"])
def test_yarn_logits_and_loss_match_transformers(name: str) -> None:
    args = replace(CONFIGS[name], rope_parameters=dict(YARN), rope_theta=None, max_position_embeddings=64)
    hf, ours = _pair(args, seed=3)
    attn = ours.model.layers[0].self_attn
    assert attn.scaling == hf.model.layers[0].self_attn.scaling
    expected = args.attn_qk_head_dim**-0.5 * (0.1 * math.log(4.0) + 1.0) ** 2
    assert attn.scaling == pytest.approx(expected, rel=1e-12)
    assert ours.model.rotary_emb.attention_scaling == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert ours.model.rotary_emb.attention_scaling != 1.0  # mscale != mscale_all_dim: a real gain
    assert torch.equal(ours.model.rotary_emb._inv_freq, hf.model.rotary_emb.inv_freq)

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, args.vocab_size, (2, 40), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 40), generator=gen)
    ref = hf(input_ids=ids).logits
    out = ours(ids)
    assert rel(out, ref) <= 1e-6
    ce = [F.cross_entropy(x.flatten(0, 1), labels.flatten()) for x in (out, ref)]
    assert rel(ce[0], ce[1]) <= 1e-5
    # YaRN matters at these sizes: default RoPE on the same weights is 100x past the tolerance.
    plain = replace(args, rope_parameters=None, rope_theta=10000.0)
    _, unscaled = _pair(plain, seed=3)
    assert rel(unscaled(ids), ref) > 1e-4


def test_legacy_rope_scaling_maps_to_yarn_and_bad_keys_are_named() -> None:
    options = from_hf_config(
        {
            "hidden_size": 32,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        }
    )
    args = from_options({"flavor": "debug", **options})
    assert args.rope_type == "yarn" and args.theta == 10000.0
    # mscale == mscale_all_dim: no cos/sin gain, the whole correction is on the softmax scale.
    assert args.softmax_scale == pytest.approx(args.attn_qk_head_dim**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    hf_dict = args.to_hf_dict()["rope_parameters"]
    assert hf_dict["rope_type"] == "yarn" and "type" not in hf_dict and hf_dict["factor"] == 40
    for params, message in (
        ({"rope_type": "yarn"}, "rope_parameters.factor: rope_type yarn needs a positive number"),
        ({"rope_type": "yarn", "factor": 4, "betta_fast": 3}, "rope_parameters.betta_fast: not a yarn key"),
        ({"rope_type": "longrope", "factor": 4}, "not supported yet for deepseek_v3: 'longrope'"),
    ):
        with pytest.raises(ValueError, match=message):
            from_options({"flavor": "debug", "rope_parameters": params})
