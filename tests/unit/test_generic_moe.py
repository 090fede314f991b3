"""The generic path with transformers' weight conversions: MoE checkpoints written by `save_pretrained`.

transformers 5.x keeps a Mixtral-style MoE's experts fused in memory (`mlp.experts.gate_up_proj`,
one 3-D tensor) but `save_pretrained` writes them per expert under the checkpoint names
(`block_sparse_moe.experts.{i}.w1.weight`, ...); GLM-4-MoE (shared experts) also stores the
router's `e_score_correction_bias` buffer. The generic path loads both through transformers' own checkpoint
conversion mapping; the first training step's loss equals transformers' own loss, and the export
reloads in transformers with the same logits.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from meshforge.checkpoint.hf import load_hf_weights, save_hf
from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict
from tests._compare import assert_close, assert_scalar_close
from tests.conftest import write_corpus
from tests.unit.test_generic_hf import TRAIN_YAML, _hf_loss

transformers = pytest.importorskip("transformers")

COMMON = {
    "vocab_size": 8192,  # the bundled tokenizer's size
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"sliding_window": None}),
    # GLM-4-MoE: shared experts, a dense-free stack and the router's `e_score_correction_bias`
    # buffer (MiniMax-M2, which has one too, is a built-in family now).
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def write_tiny_moe(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random MoE folder written by transformers' own ``save_pretrained`` (and the tokenizer)."""
    config_cls, model_cls, extra = MODELS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A non-zero bias, so that a model that skipped loading it would route differently.
                buffer.copy_(torch.linspace(-0.5, 0.5, buffer.numel()))
    model.save_pretrained(folder)
    from meshforge.data.tokenizer import build_tokenizer

    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(MODELS))
def hf_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp(f"hf_{request.param}"), request.param)


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Mixtral layout the generic EP shards (GLM-4-MoE's block is refused: see below)."""
    return write_tiny_moe(tmp_path_factory.mktemp("hf_mixtral_ep"), "mixtral")


def _load_ours(folder: Path) -> torch.nn.Module:
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(folder)}}).model
    source = resolve_model_source(model_cfg)
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    model.reset_buffers()
    load_hf_weights(model, source.family, folder)
    return model.eval()


def _reference(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))


def test_fused_experts_load_through_transformers_conversions(hf_moe: Path) -> None:
    # Without the conversion mapping: "6 weight(s) the <family> model needs are not in the checkpoint".
    ours, ref = _load_ours(hf_moe), _reference(hf_moe)
    ids = _ids()
    with torch.no_grad():
        assert_close(ours(ids), ref(ids).logits, what=f"{hf_moe.name} logits")
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


def test_first_step_loss_equals_transformers(hf_moe: Path, tmp_path: Path) -> None:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=40)
    path = tmp_path / "moe.yaml"
    path.write_text(TRAIN_YAML.format(data=corpus, model=hf_moe, extra=""))
    cfg = load_config(path, [f"--training.output_dir={tmp_path / 'run'}", "--training.steps=1"])
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    # The batch the step trains on (the loader is stateful: put it back in front).
    batch = next(trainer.data_iter)
    trainer.data_iter = itertools.chain([batch], trainer.data_iter)
    want = _hf_loss(hf_moe, batch)
    record = trainer.train_step()
    assert_scalar_close(float(record["loss"]), want, what="first-step loss")


def test_export_reloads_in_transformers_with_equal_logits(hf_moe: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    ours = _load_ours(hf_moe)
    with torch.no_grad():
        # Move every weight (buffers included), so that the reload cannot match by accident.
        for tensor in ours.state_dict().values():
            tensor.mul_(1.25)
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(hf_moe)}}).model
    family = resolve_model_source(model_cfg).family
    out = save_hf(ours, family, tmp_path / "export")
    with (
        safe_open(out / "model.safetensors", "pt") as written,
        safe_open(hf_moe / "model.safetensors", "pt") as saved,
    ):
        # The checkpoint names transformers writes (per-expert keys), not the in-memory fused ones.
        assert sorted(written.keys()) == sorted(saved.keys())
    reloaded = _reference(out)
    ids = _ids()
    with torch.no_grad():
        assert_close(reloaded(ids).logits, ours(ids), what=f"{hf_moe.name} export")


def test_ep_takes_the_fused_layout_and_refuses_others_by_class(hf_mixtral: Path) -> None:
    from meshforge.models.generic.experts import FusedExpertsAdapter
    from meshforge.parallel.expert import adapted_experts

    def generic_experts(model: torch.nn.Module, patterns: list[str]) -> list[tuple[str, torch.nn.Module]]:
        return adapted_experts(model, FusedExpertsAdapter(), patterns)

    model = _load_ours(hf_mixtral)
    chosen = generic_experts(model, ["model.layers.{*}.mlp.experts"])
    assert [name for name, _ in chosen] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = chosen[1][1]
    experts.has_bias = True  # a layout the EP forward does not compute (GPT-OSS-style biases)
    with pytest.raises(
        NotImplementedError, match=rf"{type(experts).__name__} \(model\.layers\.1\.mlp\.experts.*has_bias"
    ):
        generic_experts(model, ["model.layers.{*}.mlp.experts"])
    with pytest.raises(NotImplementedError, match=r"MixtralSparseMoeBlock"):
        generic_experts(model, ["model.layers.0.mlp"])


def test_qwen3_moe_experts_of_transformers_have_the_known_layout() -> None:
    from meshforge.models.generic.experts import layout_problem

    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        experts = transformers.Qwen3MoeForCausalLM(config).model.layers[0].mlp.experts
    assert layout_problem(experts) is None
    with torch.device("meta"):
        gpt_oss = (
            transformers.GptOssForCausalLM(
                transformers.GptOssConfig(
                    vocab_size=64,
                    hidden_size=16,
                    intermediate_size=8,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    head_dim=8,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                )
            )
            .model.layers[0]
            .mlp.experts
        )
    # GPT-OSS' experts carry biases (and interleave gate/up): refused with the reason.
    assert layout_problem(gpt_oss) == "has_bias is True, EP needs False"


def test_a_missing_expert_key_is_an_error_naming_the_file(hf_mixtral: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(hf_mixtral, broken)
    tensors = load_file(broken / "model.safetensors")
    (dropped,) = [key for key in tensors if key.endswith("layers.1.block_sparse_moe.experts.2.w3.weight")]
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: .*experts\.gate_up_proj: .*4 x \.experts\.\*\.w1\.weight, 3 x \.experts\.\*\.w3\.weight found",
    ):
        _load_ours(broken)
