"""DeepSeek-V3 multi-token prediction: the MTP forward and loss against a hand-written reference,
the main head against transformers (YaRN + one MTP layer), the published names on HF load and
export, the targets of packed rows, and the trainer's refusal for models without MTP."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from meshforge.loss.cross_entropy import mtp_cross_entropy_sum, mtp_labels
from meshforge.loss.mtp import mtp_factor
from meshforge.models.deepseek_v3.layer import DeepseekV3DecoderLayer
from meshforge.models.deepseek_v3.model import DeepseekV3ForCausalLM, build_deepseek_v3
from meshforge.models.deepseek_v3.spec import FAMILY
from tests.unit._parity import rel
from tests.unit.test_deepseek_v3 import CONFIGS, _hf_model

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _args(depths: int, **kw):
    base = replace(CONFIGS["qlora_groups_untied"], rope_parameters=dict(YARN), rope_theta=None)
    return replace(base, max_position_embeddings=64, num_nextn_predict_layers=depths, **kw)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _reference_mtp_loss(model: DeepseekV3ForCausalLM, ids, labels, segment_ids=None) -> torch.Tensor:
    """The MTP forward and loss written out: shifted embeddings, the two norms, the projection,
    the block (a decoder layer, parity-tested against transformers elsewhere), the output norm,
    the shared head, and per-position targets picked by hand."""
    a = model.args
    inner = model.model
    eps = a.rms_norm_eps
    seq = ids.shape[1]
    if segment_ids is None:
        rope = inner.rotary_emb(None, seq_len=seq, device=ids.device, dtype=torch.float32)
        mask = None
    else:
        from meshforge.models.common.attention import positions_from_segments, segment_causal_mask

        rope = inner.rotary_emb(
            positions_from_segments(segment_ids), seq_len=seq, device=ids.device, dtype=torch.float32
        )
        mask = segment_causal_mask(segment_ids)
    h = inner.embed_tokens.weight[ids]
    for layer in list(inner.layers)[: a.num_hidden_layers]:
        h = DeepseekV3DecoderLayer.forward(layer, h, rope, mask)
    h = _rms(h, inner.norm.weight, eps)
    total = torch.zeros((), dtype=torch.float64)
    for k in range(1, a.num_nextn_predict_layers + 1):
        block = inner.layers[a.num_hidden_layers + k - 1]
        ahead = torch.zeros_like(ids)
        ahead[:, : seq - k] = ids[:, k:]
        emb = inner.embed_tokens.weight[ahead]
        x = torch.cat([_rms(emb, block.enorm.weight, eps), _rms(h, block.hnorm.weight, eps)], -1)
        x = x @ block.eh_proj.weight.T
        h = _rms(DeepseekV3DecoderLayer.forward(block, x, rope, mask), block.shared_head.norm.weight, eps)
        logits = h @ model.lm_head.weight.T
        for b in range(ids.shape[0]):
            for i in range(seq - k):
                target = int(labels[b, i + k])
                same_doc = segment_ids is None or (
                    segment_ids[b, i] != 0 and segment_ids[b, i + k] == segment_ids[b, i]
                )
                if target != -100 and same_doc:
                    total = total - F.log_softmax(logits[b, i].double(), -1)[target]
    return total / a.num_nextn_predict_layers


@pytest.mark.parametrize("packed", [False, True])
def test_mtp_loss_equals_hand_written_reference(packed: bool) -> None:
    args = _args(2)
    model = build_deepseek_v3(args, device="cpu").train()
    model.set_mtp(True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (2, 21), generator=gen)
    labels = torch.randint(0, args.vocab_size, (2, 21), generator=gen)
    labels[0, 3:6] = -100
    segment_ids = None
    if packed:
        segment_ids = torch.tensor([[1] * 9 + [2] * 10 + [0] * 2, [1] * 21])
    kwargs = {"segment_ids": segment_ids} if packed else {}
    main = model(ids, **kwargs)
    outputs = model.mtp_outputs()
    assert len(outputs) == 2 and model.mtp_outputs() == []  # read once
    assert all(o.shape == main.shape for o in outputs)
    ours = mtp_cross_entropy_sum(outputs, labels, segment_ids)
    with torch.no_grad():
        expected = _reference_mtp_loss(model, ids, labels, segment_ids)
    assert rel(ours.double(), expected) <= 1e-5
    # The MTP loss trains the shared embedding and head and every parameter of each MTP block.
    ours.backward()
    for name, p in model.named_parameters():
        if (
            ".layers.2." in name
            or ".layers.3." in name
            or name in ("model.embed_tokens.weight", "lm_head.weight")
        ):
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("mode", ["fused", "chunked"])
def test_mtp_loss_through_the_hidden_state_losses_equals_the_logits_path(mode: str) -> None:
    from meshforge.loss.lm import LMLoss

    args = _args(2)
    model = build_deepseek_v3(args, device="cpu").train()
    model.set_mtp(True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 21), generator=gen)
    segment_ids = torch.tensor([[1] * 9 + [2] * 10 + [0] * 2, [1] * 21])
    model(ids, segment_ids=segment_ids)
    plain = mtp_cross_entropy_sum(model.mtp_outputs(), ids, segment_ids)
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids, segment_ids=segment_ids, return_hidden=True)
    ours = mtp_cross_entropy_sum(
        model.mtp_outputs(), ids, segment_ids, head_weight=model.lm_head.weight, loss_fn=LMLoss(mode, 8)
    )
    assert rel(ours.double(), plain.double()) <= 1e-6
    ours.backward()
    for name, grad in want.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None and rel(got, grad) <= 1e-5, name


def test_mtp_labels_shift_and_cut_at_documents() -> None:
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert mtp_labels(labels, 1).tolist() == [[11, 12, 13, 14, 15, -100]]
    assert mtp_labels(labels, 2).tolist() == [[12, 13, 14, 15, -100, -100]]
    assert mtp_labels(labels, 1, segments).tolist() == [[11, 12, -100, 14, -100, -100]]


def test_main_head_equals_transformers_with_yarn_and_one_mtp_layer() -> None:
    args = _args(1)
    hf = _hf_model(replace(args, num_nextn_predict_layers=0), seed=5)
    model = build_deepseek_v3(args, device="cpu").train()
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(f"model.layers.{args.num_hidden_layers}.") for k in missing)
    hf.train()
    model.set_mtp(True)
    ids = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    ref = hf(input_ids=ids, labels=None).logits
    out = model(ids)
    assert len(model.mtp_outputs()) == 1
    assert rel(out, ref) <= 1e-6
    loss = [F.cross_entropy(x.flatten(0, 1), labels.flatten()) for x in (out, ref)]
    assert rel(loss[0], loss[1]) <= 1e-6
    model.eval()
    model(ids)
    assert model.mtp_outputs() == []  # evaluation forwards skip the MTP depths


@pytest.mark.parametrize("tied", [False, True])
def test_hf_export_and_load_use_the_published_mtp_names(tied: bool, tmp_path: Path) -> None:
    from meshforge.checkpoint.hf import load_hf_weights, save_hf

    args = _args(1, tie_word_embeddings=tied)
    model = build_deepseek_v3(args, device="cpu")
    save_hf(model, FAMILY, tmp_path / "out")
    written = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        written.update(load_file(f))
    mtp = f"model.layers.{args.num_hidden_layers}"
    for key in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "embed_tokens.weight",
        "shared_head.head.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.0.gate_proj.weight",
        "mlp.gate.e_score_correction_bias",
    ):
        assert f"{mtp}.{key}" in written, key
    assert torch.equal(written[f"{mtp}.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(written[f"{mtp}.shared_head.head.weight"], model.lm_head.weight)

    fresh = build_deepseek_v3(args, device="meta")
    fresh.to_empty(device="cpu")
    load_hf_weights(fresh, FAMILY, tmp_path / "out")
    for (name, p), (_, q) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    # transformers loads the same folder (it builds no MTP block) with the same main logits.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (1, 12))
    with torch.no_grad():
        assert rel(model.eval()(ids), reloaded(ids).logits) <= 1e-5


def test_mtp_factor_on_a_model_without_mtp_is_an_error() -> None:
    from meshforge.models.llama.spec import FAMILY as LLAMA_FAMILY

    llama = LLAMA_FAMILY.build({"flavor": "debug"}, device="meta")
    assert mtp_factor(llama, 0.3, family="llama") == 0.0
    with pytest.raises(ValueError, match="training.mtp_loss_scaling_factor: 0.1 .* the llama family has no"):
        mtp_factor(llama, 0.1, family="llama")
    none = build_deepseek_v3(_args(0), device="meta")
    with pytest.raises(ValueError, match="model.num_nextn_predict_layers is 0"):
        mtp_factor(none, 0.5, family="deepseek_v3")
    one = build_deepseek_v3(_args(1), device="meta")
    assert mtp_factor(one, 0.3, family="deepseek_v3") == 0.3
    assert one.model.mtp_active
    with pytest.raises(ValueError, match="not supported yet: multi-token prediction .*context_parallel"):
        mtp_factor(one, 0.3, family="deepseek_v3", context_parallel=2)
    assert mtp_factor(one, 0.0, family="deepseek_v3") == 0.0
    assert not one.model.mtp_active


def test_folder_without_mtp_weights_builds_without_mtp_layers(tmp_path: Path) -> None:
    from meshforge.checkpoint.source import resolve_model_source
    from meshforge.config.root import TrainConfig

    args = _args(1)
    hf = _hf_model(replace(args, num_nextn_predict_layers=0), seed=1)
    hf.config.num_nextn_predict_layers = 1  # what transformers writes by default, with no MTP weights
    hf.save_pretrained(tmp_path)
    lines: list[str] = []
    cfg = TrainConfig.model_validate({"model": {"model_name_or_path": str(tmp_path)}})
    source = resolve_model_source(cfg.model, log=lines.append)
    assert source.options["num_nextn_predict_layers"] == 0
    assert any("num_nextn_predict_layers: 0 instead of 1" in line for line in lines)
    # Asked for in the model: section, it stays (and the missing weights are then named at load).
    cfg = TrainConfig.model_validate(
        {"model": {"model_name_or_path": str(tmp_path), "num_nextn_predict_layers": 1}}
    )
    assert resolve_model_source(cfg.model).options["num_nextn_predict_layers"] == 1
