"""`config validate` refuses what `meshforge train` refuses before its first step, naming the same key.

Each case is an ordinary mistake on a shipped config, given as a command-line override. The
trainer's own pre-flight (`Trainer.__init__`: the config rules and the paths the run reads) raises
before any process group, tokenizer or model exists, so both sides run here in milliseconds.
The layout rules at a world size (heads, experts, stages) are `test_validate_layout_rules.py`'s.
"""

from __future__ import annotations

import pytest

from meshforge.config import ConfigError, load_config
from meshforge.config.loader import split_cli_overrides
from tests.conftest import REPO, meshforge_here

DEMO = REPO / "configs" / "demo.yaml"
SFT = REPO / "configs" / "qwen3" / "sft_alpaca_tiny.yaml"
MEGATRON = REPO / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"

CASES = {
    "missing data file": (
        DEMO,
        ["--train_dataset.dataloader.data_path", "nope.jsonl"],
        "train_dataset.dataloader.data_path[0]",
    ),
    "missing model folder": (DEMO, ["--model.model_name_or_path", "./no-model"], "model.model_name_or_path"),
    "missing tokenizer folder": (
        DEMO,
        ["--model.tokenizer_name_or_path", "./no-tok"],
        "model.tokenizer_name_or_path",
    ),
    "dataset name not in dataset_info.json": (
        SFT,
        ["--train_dataset.dataset", "alpaca_dem"],
        "train_dataset.dataset[0]",
    ),
    "missing Megatron prefix": (
        MEGATRON,
        ["--train_dataset.dataloader.config.data_path", "./no/such_text_document"],
        "train_dataset.dataloader.config.data_path",
    ),
    "missing checkpoint": (DEMO, ["--checkpoint.load_path", "./no-checkpoint"], "checkpoint.load_path"),
    "model key typo": (DEMO, ["--model.num_hiden_layers", "3"], "model.num_hiden_layers"),
    "loader key typo": (
        DEMO,
        ["--train_dataset.dataloader.text_kye", "body"],
        "train_dataset.dataloader.text_kye",
    ),
    "feature not built yet": (DEMO, ["--parallelism.enable_mc2", "true"], "parallelism.enable_mc2"),
}


@pytest.mark.parametrize("case", CASES)
def test_validate_and_train_refuse_the_same_key(case: str, tmp_path) -> None:
    from meshforge.train.trainer import Trainer

    config, overrides, key = CASES[case]
    validate = meshforge_here("config", "validate", str(config), *overrides, cwd=tmp_path)
    assert validate.returncode == 2, validate.stdout + validate.stderr
    assert f"error: {key}: " in validate.stderr, validate.stderr
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        cfg = load_config(str(config), [f"--{item}" for item in split_cli_overrides(overrides)])
        with pytest.raises(ConfigError) as refused:
            Trainer(cfg, log=lambda line: None)
    assert key in [path for path, _ in refused.value.issues], refused.value.issues


def test_planning_for_another_machine_skips_the_path_checks(tmp_path) -> None:
    overrides = [
        "--model.tokenizer_name_or_path",
        "/data/models/tokenizer",
        "--checkpoint.load_path",
        "/ckpt",
    ]
    assert meshforge_here("config", "validate", str(DEMO), *overrides, cwd=tmp_path).returncode == 2
    planned = meshforge_here("config", "validate", str(DEMO), "--no-path-checks", *overrides, cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
