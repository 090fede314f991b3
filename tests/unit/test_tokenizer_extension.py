"""Tokenizer extension (add_tokens, add_special_tokens, new_special_tokens_config, split_special_tokens)
and vocabulary resizing: padded size, HF rows kept, new rows as LLaMA-Factory initialises them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from meshforge.checkpoint.hf import load_hf_weights, save_hf  # noqa: E402
from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer, extension_options, tokenizer_extension  # noqa: E402
from meshforge.models.materialize import materialize_and_init  # noqa: E402
from meshforge.models.vocab import init_new_rows, padded_size, vocab_parameters, vocab_plan  # noqa: E402
from tests._compare import assert_close

TOKENIZER = "meshforge://assets/tokenizer"  # 8192 tokens
DESCRIPTIONS = {"<think>": "the start of a reasoning", "</think>": "the end of a reasoning", "<tool>": "call"}
OPTIONS = {
    "vocab_size": 8192,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Tiny transformers Qwen3 checkpoints (random weights), untied and tied."""
    import transformers

    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        config = transformers.Qwen3Config(**OPTIONS, tie_word_embeddings=tied)
        folder = tmp_path_factory.mktemp(f"qwen3_tied{int(tied)}")
        transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
        out[tied] = folder
    return out


def _load(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _build(folder: Path, tokenizer, *, resize_vocab: bool = True):
    """The trainer's order: plan -> build on meta -> materialise -> load HF (short rows)."""
    source = resolve_model_source(config_from_dict({"model": {"model_name_or_path": str(folder)}}).model)
    old = source.family.parse_options(source.options).vocab_size
    plan = vocab_plan(tokenizer, old, resize_vocab=resize_vocab)
    with torch.device("meta"):
        model = source.family.build(plan.model_options(source.options))
    materialize_and_init(model, device=torch.device("cpu"), seed=0, init_fn=lambda *_: None)
    load_hf_weights(model, source.family, folder, vocab_plan=plan)
    return model, plan, source.family


# ------------------------------------------------------------------------------------ tokenizer
def test_add_tokens_and_special_tokens_get_new_ids() -> None:
    logs: list[str] = []
    tok = build_tokenizer(
        TOKENIZER, add_tokens=" <a>, hello ,<b>", add_special_tokens="<tool>", log=logs.append
    )
    ext = tokenizer_extension(tok)
    assert ext.tokens == ("<a>", "hello", "<b>") and ext.special_tokens == ("<tool>",)
    # `hello` is already a token: it keeps its id and does not grow the vocabulary.
    assert ext.new_ids == {"<a>": 8192, "<b>": 8193, "<tool>": 8194} and len(tok) == 8195
    assert ext.num_added == 3 and "added 3 tokens (1 already in the vocabulary)" in logs[0]
    ids = tok("x<a>y <tool>", add_special_tokens=False)["input_ids"]
    assert 8192 in ids and 8194 in ids
    # Special tokens are dropped by skip_special_tokens; ordinary added tokens are not.
    text = tok.decode(ids, skip_special_tokens=True)
    assert "<a>" in text and "<tool>" not in text
    # A list works as well as a comma string; nothing requested means an empty extension.
    assert tokenizer_extension(build_tokenizer(TOKENIZER, add_tokens=["<a>"])).new_ids == {"<a>": 8192}
    plain = tokenizer_extension(build_tokenizer(TOKENIZER))
    assert not plain.requested and plain.num_added == 0 and plain.size_before == 8192


def test_split_special_tokens() -> None:
    text = "hi <|endoftext|> there"
    kept = build_tokenizer(TOKENIZER)(text, add_special_tokens=False)["input_ids"]
    split = build_tokenizer(TOKENIZER, split_special_tokens=True)(text, add_special_tokens=False)["input_ids"]
    eod = build_tokenizer(TOKENIZER).convert_tokens_to_ids("<|endoftext|>")
    assert eod in kept and eod not in split and len(split) > len(kept)


@pytest.mark.parametrize("kind", ["yaml", "json", "mapping"])
def test_new_special_tokens_config_overrides_add_special_tokens(kind: str, tmp_path: Path) -> None:
    if kind == "yaml":
        source: object = tmp_path / "tokens.yaml"
        source.write_text("".join(f"'{k}': '{v}'\n" for k, v in DESCRIPTIONS.items()))
    elif kind == "json":
        source = tmp_path / "tokens.json"
        source.write_text(json.dumps(DESCRIPTIONS))
    else:
        source = DESCRIPTIONS
    logs: list[str] = []
    tok = build_tokenizer(
        TOKENIZER,
        add_special_tokens="<ignored>",
        new_special_tokens_config=source if kind == "mapping" else str(source),
        log=logs.append,
    )
    ext = tokenizer_extension(tok)
    assert ext.special_tokens == tuple(DESCRIPTIONS) and ext.descriptions == DESCRIPTIONS
    assert "<ignored>" not in tok.get_vocab() and "add_special_tokens is ignored" in logs[0]
    assert list(ext.new_ids.values()) == [8192, 8193, 8194]


def test_bad_options_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.add_tokens\[2\]: empty token"):
        build_tokenizer(TOKENIZER, add_tokens="<a>,<b>,")
    with pytest.raises(FileNotFoundError, match="model.new_special_tokens_config"):
        build_tokenizer(TOKENIZER, new_special_tokens_config=str(tmp_path / "missing.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- <a>\n- <b>\n")
    with pytest.raises(ValueError, match=r"list.yaml: must map each new special token"):
        build_tokenizer(TOKENIZER, new_special_tokens_config=str(bad))
    bad.write_text("'<a>': [1, 2]\n")
    with pytest.raises(ValueError, match=r"list.yaml: <a>: the description must be a string"):
        build_tokenizer(TOKENIZER, new_special_tokens_config=str(bad))


# ------------------------------------------------------------------------------------ plan
def test_vocab_plan_sizes() -> None:
    assert padded_size(8195) == 8256 and padded_size(8256) == 8256 and padded_size(1) == 64
    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS)
    plan = vocab_plan(tok, 8192, resize_vocab=False)  # tokens were added: resizing is implied
    assert (plan.old_vocab_size, plan.new_vocab_size, plan.tokenizer_size) == (8192, 8256, 8195)
    assert plan.resized and plan.num_new_rows == 64
    assert plan.descriptions == {8192: DESCRIPTIONS["<think>"], 8193: DESCRIPTIONS["</think>"], 8194: "call"}
    assert plan.model_options({"vocab_size": 8192, "x": 1}) == {"vocab_size": 8256, "x": 1}
    # A model with spare rows keeps its size (the new tokens use those rows, untouched).
    logs: list[str] = []
    roomy = vocab_plan(tok, 9000, resize_vocab=True, log=logs.append)
    assert "the 3 added tokens use existing rows" in logs[0]
    assert not roomy.resized and roomy.new_vocab_size == 9000 and roomy.model_options({"a": 1}) == {"a": 1}
    # A tokenizer bigger than the model with nothing added and no resize_vocab is refused.
    with pytest.raises(ValueError, match=r"model\.vocab_size: 8000 is smaller .* model\.resize_vocab"):
        vocab_plan(build_tokenizer(TOKENIZER), 8000, resize_vocab=False)
    assert vocab_plan(build_tokenizer(TOKENIZER), 8000, resize_vocab=True).new_vocab_size == 8192


# ------------------------------------------------------------------------------------ loading
def test_hf_rows_load_into_the_first_rows_only_with_a_plan(hf_dirs: dict[bool, Path]) -> None:
    folder = hf_dirs[False]
    stored = _load(folder)
    tok = build_tokenizer(TOKENIZER, add_special_tokens="<x>,<y>")
    model, plan, family = _build(folder, tok)
    params = dict(model.named_parameters())
    assert vocab_parameters(model) == {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert params[name].shape == (8256, 32)
        assert torch.equal(params[name][:8192], stored[name])
    assert torch.equal(params["model.norm.weight"], stored["model.norm.weight"])
    # Without the plan, the short table is an error naming the file and the key.
    with pytest.raises(
        ValueError, match=r"model\.safetensors: model\.embed_tokens\.weight has shape \(8192, 32\)"
    ):
        load_hf_weights(model, family, folder)
    # A plan whose old size is not what the file holds is an error too.
    wrong = type(plan)(8100, 8256, plan.tokenizer_size)
    with pytest.raises(ValueError, match=r"needs \(8100, 32\) \(the first 8100 of its 8256 rows"):
        load_hf_weights(model, family, folder, vocab_plan=wrong)


# ------------------------------------------------------------------------------------ new rows
def _lf_desc_reference(embedding: torch.Tensor, tok, old: int) -> dict[int, torch.Tensor]:
    """LLaMA-Factory's desc_init for one table: mean of the old input rows of the description tokens."""
    out = {}
    for i, text in enumerate(DESCRIPTIONS.values()):
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        out[old + i] = torch.nn.functional.embedding(ids[ids < old], embedding).mean(dim=0)
    return out


def test_desc_init_equals_llamafactory_and_leaves_old_rows(hf_dirs: dict[bool, Path]) -> None:
    folder = hf_dirs[False]
    stored = _load(folder)
    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS)
    model, plan, _ = _build(folder, tok)
    written = init_new_rows(model, plan, tok, "desc_init", seed=0)
    assert written == ["model.embed_tokens.weight", "lm_head.weight"]
    params = dict(model.named_parameters())
    embedding = stored["model.embed_tokens.weight"]
    expected = _lf_desc_reference(embedding, tok, 8192)
    for name in written:
        table = params[name].detach()
        assert torch.equal(table[:8192], stored[name])  # old rows untouched
        for row, value in expected.items():
            # Both tables get the mean of the description's *input* embedding rows (as LLaMA-Factory).
            torch.testing.assert_close(table[row], value, rtol=0, atol=0)
        # Padding rows: the mean of the table's own old rows (transformers' mean_resizing).
        pad_mean = stored[name].mean(dim=0)
        torch.testing.assert_close(table[8195:], pad_mean.expand(8256 - 8195, 32), rtol=0, atol=0)


def test_desc_init_cross_check_with_llamafactory(hf_dirs: dict[bool, Path], monkeypatch) -> None:
    """LLaMA-Factory's own function on transformers' resized model (runs where llamafactory imports:
    ``PYTHONPATH=build/llamafactory-ref``, as the Makefile runs its cross-checks)."""
    import importlib
    import importlib.machinery
    import sys
    import types

    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")
    if "torchaudio" not in sys.modules:
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        monkeypatch.setitem(sys.modules, "torchaudio", stub)
    pytest.importorskip("llamafactory.extras.logging")
    import llamafactory

    # llamafactory.model's __init__ pulls in trl and peft's trainers: register bare packages so only
    # embedding.py (and llamafactory.extras) is imported; all undone after the test.
    base = Path(llamafactory.__file__).parent
    for name in ("llamafactory.model", "llamafactory.model.model_utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(base / name.split(".", 1)[1].replace(".", "/"))]
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.delitem(sys.modules, "llamafactory.model.model_utils.embedding", raising=False)
    lf = importlib.import_module("llamafactory.model.model_utils.embedding")
    monkeypatch.setitem(sys.modules, "llamafactory.model.model_utils.embedding", lf)
    import transformers

    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS)
    folder = hf_dirs[False]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lf.resize_embedding_layer(reference, tok, DESCRIPTIONS, "desc_init")
    model, plan, _ = _build(folder, tok)
    init_new_rows(model, plan, tok, "desc_init", seed=0)
    ours = dict(model.named_parameters())
    for name, theirs in (
        ("model.embed_tokens.weight", reference.get_input_embeddings().weight),
        ("lm_head.weight", reference.get_output_embeddings().weight),
    ):
        assert theirs.shape == ours[name].shape == (8256, 32)
        torch.testing.assert_close(ours[name][:8195], theirs[:8195], rtol=0, atol=0)
        # Padding rows: transformers' mean_resizing samples around the mean with 1e-9 x covariance.
        torch.testing.assert_close(ours[name][8195:], theirs[8195:], rtol=0, atol=1e-3)


@pytest.mark.parametrize("mode", ["noise_init", "desc_init_w_noise"])
def test_noise_modes_are_seeded_and_sane(hf_dirs: dict[bool, Path], mode: str) -> None:
    folder = hf_dirs[False]
    stored = _load(folder)
    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS)
    tables = {}
    for seed in (0, 0, 1):
        model, plan, _ = _build(folder, tok)
        init_new_rows(model, plan, tok, mode, seed=seed)
        tables.setdefault(seed, []).append({n: p.detach().clone() for n, p in model.named_parameters()})
    (a, b), (c,) = tables[0], tables[1]
    name = "model.embed_tokens.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name][8192:], c[name][8192:])
    assert torch.equal(a[name][:8192], stored[name])
    assert not torch.equal(a[name][8192:], a["lm_head.weight"][8192:])  # each table its own noise
    std = 1 / math.sqrt(32)
    if mode == "noise_init":
        # Every new row (padding included) is the old mean plus N(0, 1/sqrt(hidden)).
        for table in ("model.embed_tokens.weight", "lm_head.weight"):
            deviation = a[table][8192:] - stored[table].mean(dim=0)
            assert abs(deviation.mean().item()) < 4 * std / math.sqrt(deviation.numel())
            assert deviation.std().item() == pytest.approx(std, rel=0.1)
    else:
        expected = _lf_desc_reference(stored[name], tok, 8192)
        deviation = torch.stack([a[name][row] - value for row, value in expected.items()])
        assert 0.5 * std < deviation.std().item() < 1.6 * std
        # Rows without a description get the plain mean, no noise.
        torch.testing.assert_close(a[name][8200], stored[name].mean(dim=0), rtol=0, atol=0)


def test_desc_mode_without_descriptions_falls_back_to_noise(hf_dirs: dict[bool, Path]) -> None:
    tok = build_tokenizer(TOKENIZER, add_special_tokens="<x>")
    logs: list[str] = []
    model, plan, _ = _build(hf_dirs[True], tok)
    assert vocab_parameters(model) == {"model.embed_tokens.weight": "embedding"}  # tied: one table
    init_new_rows(model, plan, tok, "desc_init", seed=0, log=logs.append)
    assert "using noise_init" in logs[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="model.init_special_tokens: 'bogus'"):
        init_new_rows(model, plan, tok, "bogus", seed=0)


def test_full_flow_logits_and_export(hf_dirs: dict[bool, Path], tmp_path: Path) -> None:
    """Old-token logits equal transformers' on the original checkpoint; the export reloads resized."""
    import transformers

    folder = hf_dirs[False]
    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS, add_tokens="<a>")
    model, plan, family = _build(folder, tok)
    init_new_rows(model, plan, tok, "desc_init_w_noise", seed=3)
    model.eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        theirs = reference(ids).logits
    assert ours.shape == (2, 12, 8256)
    assert_close(ours[..., :8192], theirs, what="logits")
    # New tokens run through the model and get their own logits.
    with torch.no_grad():
        new_ids = torch.tensor([[1, 8192, 8193, 8195, 2]])
        assert torch.isfinite(model(new_ids)).all()
    out = save_hf(model, family, tmp_path / "export", tokenizer=tok)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.vocab_size == 8256
    with torch.no_grad():
        assert_close(reloaded(ids).logits, ours, what="reloaded logits")
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == 8196


def test_generic_transformers_path_grows_too(tmp_path: Path) -> None:
    """A family meshforge does not build (Mistral, the generic path) resizes the same way."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(**{**OPTIONS, "tie_word_embeddings": False})
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    stored = _load(tmp_path)
    tok = build_tokenizer(TOKENIZER, add_special_tokens="<x>")
    model, plan, family = _build(tmp_path, tok)
    assert type(family).__name__ == "GenericFamily"
    assert vocab_parameters(model) == {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}
    init_new_rows(model, plan, tok, "noise_init", seed=0)
    params = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert params[name].shape == (8256, 32) and torch.equal(params[name][:8192], stored[name])
    with torch.no_grad():
        assert model(torch.tensor([[1, 8192]])).shape == (1, 2, 8256)


def test_pipeline_stages_without_the_embedding(hf_dirs: dict[bool, Path]) -> None:
    """A last pipeline stage (head only) draws the same head rows; desc modes need the embedding."""
    tok = build_tokenizer(TOKENIZER, new_special_tokens_config=DESCRIPTIONS)
    whole, plan, _ = _build(hf_dirs[False], tok)
    init_new_rows(whole, plan, tok, "noise_init", seed=0)
    last, _, _ = _build(hf_dirs[False], tok)
    last.model.embed_tokens = None  # what a pipeline split leaves on the last stage
    assert init_new_rows(last, plan, tok, "noise_init", seed=0) == ["lm_head.weight"]
    assert torch.equal(last.lm_head.weight, whole.lm_head.weight)
    with pytest.raises(
        ValueError, match="desc_init reads the input embedding, which this rank does not hold"
    ):
        init_new_rows(last, plan, tok, "desc_init", seed=0)
    last.lm_head = None  # a middle stage: nothing to do
    assert init_new_rows(last, plan, tok, "desc_init", seed=0) == []


def test_extension_options_from_the_model_section(tmp_path: Path) -> None:
    special = tmp_path / "special.yaml"
    special.write_text("'<think>': 'a reasoning'\n")
    section = {"add_tokens": "<a>", "new_special_tokens_config": str(special), "split_special_tokens": True}
    options = extension_options(config_from_dict({"model": section}).model)
    assert options == {**section, "add_special_tokens": None}
    tok = build_tokenizer(TOKENIZER, **options)
    assert tokenizer_extension(tok).new_ids == {"<a>": 8192, "<think>": 8193} and tok.split_special_tokens


@pytest.mark.slow  # whole trainings
def test_meshforge_train_with_added_tokens_exports_a_grown_model(
    hf_dirs: dict[bool, Path], tmp_path: Path
) -> None:
    """The trainer path: tokens added from the config, HF rows loaded short, new rows initialised."""
    import json

    import transformers
    import yaml

    from tests.conftest import read_metrics, train_cli, write_corpus

    descriptions = tmp_path / "special.yaml"
    descriptions.write_text(yaml.safe_dump(DESCRIPTIONS))
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=30)
    config = tmp_path / "grow.yaml"
    config.write_text(
        f"""
training: {{steps: 2, local_batch_size: 2, global_batch_size: 2, seed: 5}}
train_dataset:
  dataloader: {{type: TextDataLoader, data_path: {corpus}, seq_length: 16}}
model:
  model_name_or_path: {hf_dirs[True]}
  tokenizer_name_or_path: {TOKENIZER}
  add_tokens: "<a>"
  new_special_tokens_config: {descriptions}
  init_special_tokens: desc_init
checkpoint: {{save_hf_weights: true, save_interleaved_steps: 2}}
"""
    )
    out = tmp_path / "run"
    proc = train_cli(config, [f"--training.output_dir={out}"], cwd=tmp_path)
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert "8256" in proc.stdout + proc.stderr  # the plan is logged with the padded size
    exported = out / "hf"
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 8256
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert len(tok) == 8196 and tok.convert_tokens_to_ids("<think>") >= 8192
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape == (8256, OPTIONS["hidden_size"])
    # Offline conversion rebuilds the grown vocabulary from the run's config.yaml as well.
    from meshforge.cli.main import main

    converted = tmp_path / "converted"
    assert (
        main(["convert", "--to", "hf", str(out / "checkpoints" / "checkpoint-00000002"), str(converted)]) == 0
    )
    again = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    torch.testing.assert_close(again.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert len(transformers.AutoTokenizer.from_pretrained(converted)) == 8196
