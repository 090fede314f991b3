"""LoRA adapters against PEFT on the same tiny transformers model, plus target selection errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.lora.apply import LoraSettings, apply_lora, select_targets, trainable_names  # noqa: E402
from meshforge.lora.layer import adapters_detached, init_adapter_, lora_linears  # noqa: E402
from tests.unit._parity import load_from_hf, rel  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_theta=10_000.0,
)
REGEX = r".*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"


def _qwen3_pair(seed: int = 0):
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import Qwen3ForCausalLM

    torch.manual_seed(seed)
    args = Qwen3Args(**SMALL)
    cfg = transformers.Qwen3Config(**args.to_hf_dict())
    cfg._attn_implementation = "sdpa"
    hf = transformers.Qwen3ForCausalLM(cfg).float()
    ours = Qwen3ForCausalLM(args)
    load_from_hf(ours, hf)
    return hf, ours


def _init_adapters(model: torch.nn.Module, settings: LoraSettings, seed: int = 7) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                init_adapter_(name, param, gen, a_std=settings.a_std, b_std=settings.b_std)


def _peft_twin(hf: torch.nn.Module, ours: torch.nn.Module, settings: LoraSettings):
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=0.0,
        target_modules=settings.target_modules,
    )
    model = peft.get_peft_model(hf, config)
    ours_params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                key = name.removeprefix("base_model.model.").replace(".default.", ".")
                param.copy_(ours_params[key])
    return model


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def test_same_init_gives_peft_loss_and_gradients() -> None:
    hf, ours = _qwen3_pair()
    settings = LoraSettings(target_modules=REGEX, rank=4, alpha=8, a_std=0.05, b_std=0.05)
    applied = apply_lora(ours, settings, adapter_dtype=torch.float32)
    assert len(applied.targets) == 2 * 5
    _init_adapters(ours, settings)
    twin = _peft_twin(hf, ours, settings)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=gen)
    labels = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=gen)
    ref = _loss(twin(input_ids=ids).logits, labels)
    out = _loss(ours(ids), labels)
    assert rel(out, ref) <= 1e-5
    ref.backward()
    out.backward()
    twin_grads = {
        n.removeprefix("base_model.model.").replace(".default.", "."): p.grad
        for n, p in twin.named_parameters()
        if p.requires_grad
    }
    names = trainable_names(ours)
    assert sorted(names) == sorted(twin_grads)
    for name, param in ours.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and rel(param.grad, twin_grads[name]) <= 1e-5, name
        else:
            assert param.grad is None, name
    # B starts non-zero here, so A takes a gradient too: both matrices are checked.
    assert all(float(twin_grads[n].abs().sum()) > 0 for n in names)


def test_base_frozen_adapters_only_are_optimized_and_base_is_unchanged() -> None:
    from meshforge.optim.build import build_optimizer

    _, ours = _qwen3_pair(seed=2)
    settings = LoraSettings(target_modules=("q_proj", "v_proj"), rank=2, alpha=4)
    apply_lora(ours, settings, adapter_dtype=torch.float32)
    _init_adapters(ours, settings)
    base = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    opt = build_optimizer(
        ours.named_parameters(),
        type="AdamW",
        learning_rate=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
        weight_decay_include=None,
        weight_decay_exclude=None,
        options={},
    )
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        loss = _loss(ours(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    for name, param in ours.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, base[name]), name
    optimized = {id(p) for group in opt.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in ours.parameters() if p.requires_grad}
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    adapter_bytes = sum(p.numel() * p.element_size() for p in ours.parameters() if p.requires_grad)
    assert state_bytes == 2 * adapter_bytes  # AdamW: exp_avg and exp_avg_sq of the adapters only


def test_all_targets_every_decoder_linear_and_exclude_layers() -> None:
    _, ours = _qwen3_pair()
    everything = select_targets(ours, "all")
    assert {name.split(".", 3)[3] for name, _ in everything} == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
    assert not any("lm_head" in name or "embed" in name for name, _ in everything)
    pairs = [name for name, _ in select_targets(ours, "q_proj, v_proj")]  # LLaMA-Factory's spelling
    assert pairs == [name for name, _ in select_targets(ours, ["q_proj", "v_proj"])] and len(pairs) == 4
    kept = select_targets(ours, "all", frozenset({0}))
    assert kept and all(name.startswith("model.layers.1.") for name, _ in kept)


def test_bad_targets_name_the_key() -> None:
    _, ours = _qwen3_pair()
    with pytest.raises(ValueError, match=r"lora_config.target_modules: '.\*nothing' matches no linear layer"):
        select_targets(ours, ".*nothing")
    with pytest.raises(ValueError, match=r"lora_config.target_modules: .* not a valid regular expression"):
        select_targets(ours, "(q_proj")
    with pytest.raises(ValueError, match=r"lora_config.target_modules: 'model.layers.0.mlp' is a"):
        select_targets(ours, r"model\.layers\.0\.mlp")
    with pytest.raises(ValueError, match=r"after lora_config.exclude_layers"):
        select_targets(ours, ".*q_proj", frozenset({0, 1}))


def test_experts_are_refused_by_name() -> None:
    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
    from meshforge.models.qwen3_moe.model import Qwen3MoeForCausalLM

    fields = Qwen3MoeArgs.__dataclass_fields__
    opts = {k: v for k, v in SMALL.items() if k in fields}
    model = Qwen3MoeForCausalLM(
        Qwen3MoeArgs(**opts, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    )
    with pytest.raises(ValueError, match=r"is an experts container"):
        select_targets(model, r".*\.experts")
    # `all` takes the linears (attention and router) and leaves fused experts alone.
    assert not any("experts" in name for name, _ in select_targets(model, "all"))


def test_detached_adapters_show_the_base_names() -> None:
    _, ours = _qwen3_pair()
    base_names = [n for n, _ in ours.named_parameters()]
    apply_lora(ours, LoraSettings(target_modules=".*q_proj"), adapter_dtype=torch.float32)
    with adapters_detached(ours):
        assert [n for n, _ in ours.named_parameters()] == base_names
    assert len(lora_linears(ours)) == 2 and len(list(ours.parameters())) == len(base_names) + 4


def test_frozen_base_is_kept_in_the_compute_dtype() -> None:
    _, ours = _qwen3_pair()
    settings = LoraSettings(target_modules=".*v_proj", rank=2, alpha=2, b_std=0.02)
    apply_lora(ours, settings, adapter_dtype=torch.float32, frozen_dtype=torch.bfloat16)
    _init_adapters(ours, settings)
    for name, param in ours.named_parameters():
        assert param.dtype == (torch.float32 if param.requires_grad else torch.bfloat16), name
    ids = torch.randint(0, SMALL["vocab_size"], (1, 8))
    loss = _loss(ours(ids).float(), ids)
    loss.backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32 for p in ours.parameters() if p.requires_grad
    )
