"""MindSpeed import with `data_manager_type: mg`: Megatron data flags land where the Megatron loader reads them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from meshforge.config import ConfigError, load_config, unsupported_features, validate_config
from meshforge.utils.resources import resolve_path

MG = """\
model_name_or_path: /m
stage: pt
data_manager_type: mg
dataset: {dataset}
cutoff_len: 64
max_steps: 3
per_device_train_batch_size: {batch}
"""


def _load(tmp_path, extra: str = "", *, dataset: str = "/data/a_text_document", batch: int = 1, log=None):
    path = tmp_path / "ms.yaml"
    path.write_text(MG.format(dataset=dataset, batch=batch) + extra, encoding="utf-8")
    return load_config(path, log=log)


def test_reset_attention_mask_goes_to_the_megatron_config(tmp_path):
    lines: list[str] = []
    cfg = _load(tmp_path, "reset_attention_mask: true\nappend_eod: true\n", log=lines.append)
    data = cfg.train_dataset
    assert data.dataloader.type == "BlendedMegatronDatasetDataLoader"
    assert data.dataloader.model_extra["config"] == {
        "data_path": "/data/a_text_document",
        "seq_length": 64,
        "reset_attention_mask": True,
        "append_eod": True,
    }
    # not in the SFT-only fields, so nothing is refused as "read only by SFTDataLoader"
    assert data.reset_attention_mask is False and data.append_eod is False
    refused = unsupported_features(cfg)
    assert not [key for key in refused if key.startswith("train_dataset")], refused
    assert any(
        line.startswith("reset_attention_mask -> train_dataset.dataloader.config.reset_attention_mask = True")
        for line in lines
    )
    # append_eod steers the conversion of raw files (data/megatron/raw.py)
    assert "append_eod -> train_dataset.dataloader.config.append_eod = True" in lines


def test_reset_attention_mask_needs_append_eod(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "reset_attention_mask: true\n")
    assert "reset_attention_mask" in str(err.value) and "append_eod: true" in str(err.value)
    with pytest.raises(ConfigError):
        _load(tmp_path, "reset_attention_mask: true\nappend_eod: false\n")


def test_reset_attention_mask_any_batch_size(tmp_path):
    # segment_ids separate documents at any micro-batch size: MindSpeed's batch-1 rule (for its
    # unpadded actual_seq_len) is not carried over.
    cfg = _load(tmp_path, "reset_attention_mask: true\nappend_eod: true\n", batch=4)
    report = validate_config(cfg)
    assert not [e for e in report.errors if "reset_attention_mask" in str(e)], report.errors


def test_append_eod_alone_goes_to_the_raw_data_conversion(tmp_path):
    lines: list[str] = []
    cfg = _load(tmp_path, "append_eod: true\n", log=lines.append)
    assert cfg.train_dataset.dataloader.model_extra["config"]["append_eod"] is True
    assert cfg.train_dataset.append_eod is False
    assert "append_eod -> train_dataset.dataloader.config.append_eod = True" in lines


def test_create_attention_mask_and_split(tmp_path):
    cfg = _load(tmp_path, "create_attention_mask_in_dataloader: true\nsplit: '98,2,0'\n")
    config = cfg.train_dataset.dataloader.model_extra["config"]
    assert config["create_attention_mask"] is True and config["split"] == "98,2,0"
    assert cfg.train_dataset.create_attention_mask_in_dataloader is False


def test_megatron_data_is_never_reshuffled_by_the_loader(tmp_path):
    # MindSpeed's mg path reads with MegatronPretrainingSampler (in order) whatever disable_shuffling
    # says; its default (False) would otherwise turn the loader's shuffle on.
    lines: list[str] = []
    assert _load(tmp_path, log=lines.append).train_dataset.dataloader.shuffle is False
    cfg = _load(tmp_path, "disable_shuffling: false\n", log=lines.append)
    assert cfg.train_dataset.dataloader.shuffle is False
    assert any(
        line.startswith("disable_shuffling = False -> no effect with data_manager_type 'mg'")
        for line in lines
    )
    lines.clear()
    assert (
        _load(tmp_path, "disable_shuffling: true\n", log=lines.append).train_dataset.dataloader.shuffle
        is False
    )
    assert any(
        line.startswith("disable_shuffling = True -> no effect with data_manager_type 'mg'") for line in lines
    )


def test_lf_keeps_sft_fields_and_shuffles(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text(
        "model_name_or_path: /m\ndata_manager_type: lf\ndataset: alpaca\ntemplate: qwen3\n"
        "reset_attention_mask: true\nappend_eod: true\nper_device_train_batch_size: 1\n",
        encoding="utf-8",
    )
    cfg = load_config(path)
    data = cfg.train_dataset
    assert data.dataloader.type == "SFTDataLoader" and data.dataloader.shuffle is True
    assert data.reset_attention_mask is True and data.append_eod is True
    assert "config" not in (data.dataloader.model_extra or {})


def test_imported_flags_reach_the_gpt_dataset(tmp_path):
    """End to end: the imported config builds a loader whose batches separate documents."""
    from meshforge.data.build import LoaderContext, build_train_loader
    from meshforge.data.tokenizer import build_tokenizer

    src = resolve_path("meshforge://assets/megatron/python_docstrings_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(src.with_suffix(suffix), tmp_path / f"docs{suffix}")
    cfg = _load(
        tmp_path, "reset_attention_mask: true\nappend_eod: true\n", dataset=str(tmp_path / "docs"), batch=2
    )
    loader = build_train_loader(
        cfg.train_dataset,
        LoaderContext(
            tokenizer=build_tokenizer("meshforge://assets/tokenizer"),
            local_batch_size=2,
            dp_rank=0,
            dp_size=1,
            seed=int(cfg.training.seed),
            global_batch_size=2,
            total_steps=3,
        ),
    )
    batch = next(loader)
    assert set(batch) >= {"input_ids", "labels", "position_ids", "segment_ids"}
    eod = 0  # <|endoftext|> of the bundled tokenizer, appended by preprocess --append-eod
    ids, seg = batch["input_ids"].numpy(), batch["segment_ids"].numpy()
    for row_ids, row_seg in zip(ids, seg, strict=True):
        # a new segment starts right after each EOD (and nowhere else)
        starts = np.flatnonzero(np.diff(row_seg)) + 1
        assert np.array_equal(starts, np.flatnonzero(row_ids[:-1] == eod) + 1)
    # positions keep running across documents (MindSpeed hard-codes reset_position_ids=False)
    assert np.array_equal(batch["position_ids"][0].numpy(), np.arange(64))


def test_data_manager_and_stage_pair(tmp_path):
    # MindSpeed's data factory accepts only (sft, lf) and (pt, mg)
    path = tmp_path / "pair.yaml"
    path.write_text("model_name_or_path: /m\ndata_manager_type: mg\ndataset: /d/a\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path)  # stage defaults to sft
    assert "data_manager_type" in str(err.value) and "needs stage 'pt'" in str(err.value)
    path.write_text("model_name_or_path: /m\nstage: pt\n", encoding="utf-8")  # lf by default
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "stage" in str(err.value) and "needs stage 'sft'" in str(err.value)
