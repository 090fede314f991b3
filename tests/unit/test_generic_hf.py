"""The generic Hugging Face path: a transformers family meshforge does not build trains unchanged.

A tiny `transformers.MistralForCausalLM` (no built-in meshforge family) is saved with
`save_pretrained`; `meshforge train` with only `model.model_name_or_path` trains it; the first
loss equals transformers' own loss on the same first batch; the export reloads in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshforge.checkpoint.hf import load_hf_weights
from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict
from tests._compare import assert_close
from tests.conftest import read_metrics, train_cli, write_corpus

transformers = pytest.importorskip("transformers")

MISTRAL = {
    "vocab_size": 8192,  # the bundled tokenizer's size
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "sliding_window": None,
    "tie_word_embeddings": False,
}

TRAIN_YAML = """
training:
  steps: 3
  local_batch_size: 2
  global_batch_size: 2
  seed: 5
  deterministic: true
lr_scheduler:
  type: ConstantWarmUpLR
  learning_rate: 1.e-3
  warmup_steps: 0
train_dataset:
  dataloader:
    type: TextDataLoader
    data_path: {data}
    seq_length: 32
model:
  model_name_or_path: {model}
{extra}
"""


@pytest.fixture(scope="module")
def hf_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf_mistral")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**MISTRAL))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    from meshforge.data.tokenizer import build_tokenizer

    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(folder)
    return folder


def _config(tmp_path: Path, model: Path, extra: str = "") -> Path:
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, num_docs=40)
    path = tmp_path / "generic.yaml"
    path.write_text(TRAIN_YAML.format(data=corpus, model=model, extra=extra))
    return path


def _hf_loss(folder: Path, batch: dict[str, torch.Tensor]) -> float:
    """transformers' model on the batch (its 4-D mask for packed documents), mean token loss."""
    from meshforge.models.common.attention import segment_causal_mask

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kwargs = {"position_ids": batch.get("position_ids")}
    if "segment_ids" in batch:
        kwargs["attention_mask"] = segment_causal_mask(batch["segment_ids"])
    with torch.no_grad():
        logits = model(batch["input_ids"], **kwargs).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    ).item()


def _first_batch(config: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(config, [f"--training.output_dir={tmp_path / 'probe'}"])
    trainer = Trainer(cfg, log=lambda _msg: None)
    trainer.setup()
    return next(iter(trainer.run.data.loader))


@pytest.mark.slow  # whole trainings
def test_generic_family_trains_with_transformers_first_loss_and_exports(
    hf_mistral: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, hf_mistral)
    run = tmp_path / "run"
    proc = train_cli(
        config, [f"--training.output_dir={run}", "--checkpoint.save_hf_weights=true"], cwd=tmp_path
    )
    assert "generic transformers path" in proc.stdout
    assert "loaded 21 Hugging Face weights" in proc.stdout
    metrics = read_metrics(run)
    assert len(metrics) == 3
    batch = _first_batch(config, tmp_path)
    assert metrics[0]["loss"] == pytest.approx(_hf_loss(hf_mistral, batch), rel=1e-5)

    export = run / "hf"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "MistralForCausalLM"
    ids = torch.randint(0, MISTRAL["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    ours = _load_ours(export)
    with torch.no_grad():
        ref = reloaded(ids).logits
        err = (ours(ids) - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item()
    # Training moved the weights away from the starting checkpoint.
    start = transformers.AutoModelForCausalLM.from_pretrained(hf_mistral, dtype=torch.float32)
    assert not torch.equal(start.lm_head.weight, reloaded.lm_head.weight)


def _load_ours(folder: Path, overrides: dict | None = None) -> torch.nn.Module:
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(folder), **(overrides or {})}}).model
    source = resolve_model_source(model_cfg)
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    model.reset_buffers()
    load_hf_weights(model, source.family, folder)
    return model.eval()


def test_packed_segments_match_separate_documents(hf_mistral: Path) -> None:
    model = _load_ours(hf_mistral)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 8192, (1, 6), generator=gen), torch.randint(0, 8192, (1, 5), generator=gen)
    packed = torch.cat([a, b], dim=1)
    segments = torch.tensor([[1] * 6 + [2] * 5])
    positions = torch.tensor([list(range(6)) + list(range(5))])
    with torch.no_grad():
        out = model(packed, position_ids=positions, segment_ids=segments)
        alone = torch.cat([model(a), model(b)], dim=1)
    assert_close(out, alone, what="packed vs alone")


def test_overrides_are_logged_and_seeded_init_is_hf_style(hf_mistral: Path) -> None:
    lines: list[str] = []
    model_cfg = config_from_dict(
        {"model": {"model_name_or_path": str(hf_mistral), "rms_norm_eps": 1e-3}}
    ).model
    source = resolve_model_source(model_cfg, log=lines.append)
    assert any("model.rms_norm_eps: 0.001 overrides 1e-06" in line for line in lines), lines
    model = source.family.build(source.options)
    assert model.config.rms_norm_eps == 1e-3
    gen = torch.Generator().manual_seed(0)
    norm = torch.empty(32)
    model.init_full_parameter_("model.layers.0.input_layernorm.weight", norm, gen)
    assert torch.equal(norm, torch.ones(32))
    weight = torch.empty(64, 32)
    model.init_full_parameter_("model.layers.0.mlp.up_proj.weight", weight, gen)
    assert weight.std().item() == pytest.approx(model.config.initializer_range, rel=0.2)


def test_unknown_transformers_family_and_remote_code_are_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba9", "architectures": ["Mamba9"]}))
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(tmp_path)}}).model
    with pytest.raises(ValueError, match=r"not supported yet: model family.*generic transformers path"):
        resolve_model_source(model_cfg)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps(
            {"model_type": "custom_lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
        )
    )
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(remote)}}).model
    with pytest.raises(ValueError, match=r"model\.trust_remote_code"):
        resolve_model_source(model_cfg)


def test_fsdp_module_patterns_are_checked_against_the_model(hf_mistral: Path) -> None:
    from meshforge.parallel.fsdp import apply_fsdp_patterns
    from meshforge.utils.patterns import match_modules

    model = _load_ours(hf_mistral)
    names = [name for name, _ in match_modules(model, ["model.layers.{}", "lm_head"], key_path="p")]
    assert names == ["model.layers.0", "model.layers.1", "lm_head"]
    with pytest.raises(ValueError, match=r"parallelism\.fsdp_modules\[1\].*matches no module"):
        apply_fsdp_patterns(
            model,
            None,
            fsdp_modules=["model.layers.{}", "model.blocks.{}"],
            param_dtype=None,
            reduce_dtype=torch.float32,
        )
