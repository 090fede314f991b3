"""Hugging Face interop: load transformers checkpoints, match their logits, export back, convert.

A tiny `transformers.Qwen3ForCausalLM` with random weights is saved with `save_pretrained` (one
file, and sharded with a small `max_shard_size`); meshforge loads it and must give the same
logits; its export must load in transformers with the same logits again. The end-to-end cases
run `meshforge train` / `meshforge convert` on such a folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from meshforge.checkpoint.hf import INDEX_FILE, find_hf_weights, load_hf_weights, read_hf_config, save_hf
from meshforge.checkpoint.source import resolve_model_source
from meshforge.config import config_from_dict
from meshforge.models.registry import resolve_family
from tests.conftest import read_metrics, train_cli, write_corpus

transformers = pytest.importorskip("transformers")

HF_OPTIONS = {
    "vocab_size": 8192,  # the bundled tokenizer's size, so `meshforge train` can use the folder
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
}


def _save_hf_model(
    folder: Path, *, tied: bool, shard: str | None, seed: int = 0, options: dict | None = None
) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{**HF_OPTIONS, **(options or {})}, tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg)
    # Non-trivial norm weights, so a norm loaded as ones would be caught.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    from meshforge.data.tokenizer import build_tokenizer

    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_hf_model(tmp_path_factory.mktemp("hf_tied"), tied=True, shard=None)


@pytest.fixture(scope="module")
def hf_untied_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_hf_model(tmp_path_factory.mktemp("hf_untied"), tied=False, shard="200KB", seed=1)


def _load_ours(folder: Path, overrides: dict | None = None, log=None) -> torch.nn.Module:
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(folder), **(overrides or {})}}).model
    source = resolve_model_source(model_cfg, log=log)
    with torch.device("meta"):
        model = source.family.build(source.options)
    model.to_empty(device="cpu")
    load_hf_weights(model, source.family, folder)
    return model.eval()


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # 1e-5 relative to the logits' scale: the HF-parity bound of every built-in family.
    err = (ours - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


@pytest.mark.parametrize("which", ["hf_tied", "hf_untied_sharded"])
def test_loaded_model_matches_transformers_logits(which: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(which)
    assert (folder / INDEX_FILE).is_file() == (which == "hf_untied_sharded")
    ours = _load_ours(folder)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (which == "hf_tied")
    ids = torch.randint(0, HF_OPTIONS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours(ids)
    _assert_close(logits, _hf_logits(folder, ids))


@pytest.mark.parametrize("which", ["hf_tied", "hf_untied_sharded"])
def test_export_loads_in_transformers_with_the_same_logits(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    folder: Path = request.getfixturevalue(which)
    ours = _load_ours(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    out = save_hf(ours, resolve_family("qwen3"), tmp_path / "export", tokenizer=tokenizer, shard_size="150KB")
    index = json.loads((out / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert ("lm_head.weight" in index["weight_map"]) == (which == "hf_untied_sharded")
    assert read_hf_config(out)["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / "tokenizer.json").is_file()
    ids = torch.randint(0, HF_OPTIONS["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = ours(ids)
    _assert_close(logits, _hf_logits(out, ids))
    # One shard when everything fits: `model.safetensors`, no index (as transformers writes it).
    single = save_hf(ours, resolve_family("qwen3"), tmp_path / "single")
    assert (single / "model.safetensors").is_file() and not (single / INDEX_FILE).exists()


def test_exported_weights_take_the_users_umask(hf_tied: Path, tmp_path: Path) -> None:
    import os
    import stat

    ours = _load_ours(hf_tied)
    before = os.umask(0o027)
    try:
        out = save_hf(ours, resolve_family("qwen3"), tmp_path / "export", shard_size="150KB")
    finally:
        os.umask(before)
    # As `open()` makes config.json: the safetensors library alone would make them 0600.
    for file in [*out.glob("*.safetensors"), out / "config.json"]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o640, file


def test_missing_shard_and_missing_weights_are_named(hf_untied_sharded: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hf_untied_sharded, broken)
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: {victim.name}"):
        find_hf_weights(broken)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no Hugging Face weights .*train_from_scratch"):
        find_hf_weights(empty)


def test_missing_unexpected_and_misshaped_weights_are_errors(hf_tied: Path) -> None:
    with pytest.raises(ValueError, match=r"not in the checkpoint: model\.layers\.2\."):
        _load_ours(hf_tied, {"num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"have no place in the qwen3 model.*model\.layers\.1\."):
        _load_ours(hf_tied, {"num_hidden_layers": 1})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(64, 32\)"):
        _load_ours(hf_tied, {"intermediate_size": 48})


def test_config_json_gives_family_and_overrides_are_logged(hf_tied: Path) -> None:
    lines: list[str] = []
    model_cfg = config_from_dict(
        {"model": {"model_name_or_path": str(hf_tied), "rms_norm_eps": 1e-5, "num_hidden_layers": 2}}
    ).model
    source = resolve_model_source(model_cfg, log=lines.append)
    assert source.family.name == "qwen3" and source.hf_dir == hf_tied
    assert source.options["rms_norm_eps"] == 1e-5 and source.options["tie_word_embeddings"] is True
    assert len(lines) == 1 and "model.rms_norm_eps: 1e-05 overrides 1e-06" in lines[0]


def test_bad_option_names_config_json_as_its_source(hf_tied: Path) -> None:
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(hf_tied), "hidden_sise": 8}}).model
    with pytest.raises(ValueError, match=r"hidden_sise.*did you mean 'hidden_size'.*config\.json"):
        resolve_model_source(model_cfg)


def test_unbuilt_family_in_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba9", "architectures": ["Mamba9"]}))
    model_cfg = config_from_dict({"model": {"model_name_or_path": str(tmp_path)}}).model
    with pytest.raises(ValueError, match=r"not supported yet: model family.*generic transformers path"):
        resolve_model_source(model_cfg)


TRAIN_YAML = """
training:
  steps: 2
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
{model}
checkpoint:
  save_interleaved_steps: 2
"""


def _config(tmp_path: Path, name: str, model_lines: str) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus, num_docs=40)
    path = tmp_path / f"{name}.yaml"
    path.write_text(TRAIN_YAML.format(data=corpus, model=model_lines))
    return path


@pytest.mark.slow  # whole trainings
def test_train_from_hf_folder_export_convert_and_load_path(hf_untied_sharded: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from meshforge.cli.main import main
    from tests.distributed._layouts import train_one

    # 1) model_name_or_path only: family, shapes and tokenizer from the folder; one override.
    cfg = _config(
        tmp_path, "from_hf", f"  model_name_or_path: {hf_untied_sharded}\n  max_position_embeddings: 64"
    )
    run = tmp_path / "run"
    proc = train_cli(cfg, [f"--training.output_dir={run}", "--checkpoint.save_hf_weights=true"], cwd=tmp_path)
    assert "model.max_position_embeddings: 64 overrides 128" in proc.stdout
    assert "loaded 25 Hugging Face weights" in proc.stdout
    assert f"Hugging Face export in {run / 'hf'}" in proc.stdout
    first_loss = read_metrics(run)[0]["loss"]

    # The export loads in transformers and matches our model loaded from it.
    export = run / "hf"
    ids = torch.randint(0, HF_OPTIONS["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = _load_ours(export)(ids)
    _assert_close(ours, _hf_logits(export, ids))
    assert (export / "tokenizer.json").is_file()

    # 2) convert --to hf of the final DCP step gives exactly the end-of-training export.
    converted = tmp_path / "converted_hf"
    assert (
        main(["convert", "--to", "hf", str(run / "checkpoints" / "checkpoint-00000002"), str(converted)]) == 0
    )
    exported = load_file(str(export / "model.safetensors"))
    again = load_file(str(converted / "model.safetensors"))
    assert exported.keys() == again.keys()
    assert all(torch.equal(exported[k], again[k]) for k in exported)

    # model.train_from_scratch: the folder's config and tokenizer, random weights.
    scratch = tmp_path / "scratch"
    proc = train_one(
        cfg,
        [f"--training.output_dir={scratch}", "--model.train_from_scratch=true", "--training.steps=1"],
        cwd=tmp_path,
    )
    assert (
        "random init (model.train_from_scratch)" in proc.stdout and "Hugging Face weights" not in proc.stdout
    )
    assert read_metrics(scratch)[0]["loss"] != pytest.approx(first_loss, rel=1e-3)

    # 3) checkpoint.load_path naming the HF folder: refused with optimizer state, loads without.
    explicit = _config(
        tmp_path,
        "load_path",
        "  model_type: qwen3\n  tokenizer_name_or_path: meshforge://assets/tokenizer\n"
        + "".join(f"  {k}: {v}\n" for k, v in HF_OPTIONS.items())
        + "  tie_word_embeddings: false",
    )
    with pytest.raises(AssertionError, match="is a Hugging Face checkpoint; resuming optimizer state"):
        train_cli(explicit, [f"--checkpoint.load_path={hf_untied_sharded}"], cwd=tmp_path)
    run_hf = tmp_path / "run_hf"
    train_one(
        explicit,
        [
            f"--training.output_dir={run_hf}",
            f"--checkpoint.load_path={hf_untied_sharded}",
            "--checkpoint.no_load_optim=true",
        ],
        cwd=tmp_path,
    )
    assert read_metrics(run_hf)[0]["loss"] == pytest.approx(first_loss, rel=1e-6)

    # 4) convert --to dcp, then load that step folder weights-only: the same starting loss.
    dcp_dir = tmp_path / "dcp" / "checkpoint-00000000"
    assert main(["convert", "--to", "dcp", str(hf_untied_sharded), str(dcp_dir)]) == 0
    assert (dcp_dir / "COMPLETE").is_file() and (dcp_dir / "model.yaml").is_file()
    run_dcp = tmp_path / "run_dcp"
    train_one(
        explicit,
        [
            f"--training.output_dir={run_dcp}",
            f"--checkpoint.load_path={dcp_dir}",
            "--checkpoint.no_load_optim=true",
        ],
        cwd=tmp_path,
    )
    assert read_metrics(run_dcp)[0]["loss"] == pytest.approx(first_loss, rel=1e-6)


def test_convert_refusals_name_the_folder(
    hf_tied: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshforge.cli.main import main

    assert main(["convert", "--to", "hf", str(tmp_path / "nothere"), str(tmp_path / "o")]) == 2
    assert f"convert: {tmp_path / 'nothere'} does not exist" in capsys.readouterr().err
    step = tmp_path / "ckpts" / "checkpoint-00000000"
    assert main(["convert", "--to", "dcp", str(hf_tied), str(step)]) == 0
    assert main(["convert", "--to", "dcp", str(hf_tied), str(step)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    # No run folder around the step: the run's config.yaml must be given.
    assert main(["convert", "--to", "hf", str(step), str(tmp_path / "o")]) == 2
    assert "pass it with --config" in capsys.readouterr().err


def _copy(folder: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(folder, dest)
    return dest


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.procs
def test_truncated_safetensors_in_model_name_or_path_is_one_line(hf_tied: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    broken = _copy(hf_tied, tmp_path / "broken")
    _truncate(broken / "model.safetensors")
    config = _config(tmp_path, "broken", f"  model_name_or_path: {broken}")
    proc = subprocess.run(
        [sys.executable, "-m", "meshforge", "train", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: {broken / 'model.safetensors'}: not a valid safetensors file" in proc.stderr


def test_truncated_shard_and_broken_index_are_named(hf_untied_sharded: Path, tmp_path: Path) -> None:
    from meshforge.checkpoint.readers import open_safetensors

    broken = _copy(hf_untied_sharded, tmp_path / "shard")
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    _truncate(victim)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(victim))}: not a valid safetensors file .*truncated"
    ):
        with open_safetensors(victim):
            pass
    # The loader opens shards lazily: the truncated one is named when its first weight is read.
    with pytest.raises(ValueError, match=rf"{re.escape(str(victim))}: not a valid safetensors file"):
        _load_ours(broken)

    index = _copy(hf_untied_sharded, tmp_path / "index") / INDEX_FILE
    index.write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match=rf"{re.escape(str(index))}: not valid JSON"):
        find_hf_weights(index.parent)
    index.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{re.escape(str(index))}: must hold a JSON object, got list"):
        find_hf_weights(index.parent)
    index.write_text('{"weight_map": {"model.norm.weight": 3}}')
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(index))}: `weight_map` values must be shard file names"
    ):
        find_hf_weights(index.parent)


def test_broken_config_json_is_named(hf_tied: Path, tmp_path: Path) -> None:
    config = _copy(hf_tied, tmp_path / "cfg") / "config.json"
    config.write_text('{"model_type": "qwen3",')
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))}: not valid JSON"):
        read_hf_config(config.parent)
    config.write_text('"qwen3"')
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))}: must hold a JSON object, got str"):
        read_hf_config(config.parent)
    config.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))}: not a UTF-8 text file"):
        read_hf_config(config.parent)
