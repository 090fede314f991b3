"""Overrides on the command line in both forms, and the config file as a positional argument.

MindSpeed-LLM's launch scripts run `train_fsdp2.py CONFIG.yaml --model.model_name_or_path ./m/
--data.dataset '{"file_name": ...}' --parallel.fsdp_size 16 --optimization.use_flash_attn True`;
the same tokens must work after `meshforge train` and `meshforge config validate/show/import`.
"""

from __future__ import annotations

import pytest

from meshforge.cli.config import main
from meshforge.cli.main import _positional_config, split_overrides
from meshforge.config import ConfigError, load_config
from meshforge.config.loader import split_cli_overrides

MS = """\
model:
  model_id: qwen3
  model_name_or_path: /models/tiny
data:
  data_manager_type: mg
  cutoff_len: 64
parallel:
  recompute: False
training:
  stage: pt
  output_dir: ./out
  max_steps: 3
"""

LAUNCH = [
    "--model.model_name_or_path",
    "/models/other/",
    "--data.dataset",
    '{"file_name": "./train-00000-of-00001.parquet"}',
    "--parallel.fsdp_size",
    "16",
    "--training.per_device_train_batch_size=2",
    "--optimization.use_fused_rmsnorm",
    "True",
    "--parallel.fsdp_modules",
    "model.layers.{*}",
    "lm_head",
    "--training.save_async",
]


def test_both_override_forms_lists_json_and_bare_flags():
    assert split_cli_overrides(LAUNCH) == [
        "model.model_name_or_path=/models/other/",
        'data.dataset={"file_name": "./train-00000-of-00001.parquet"}',
        "parallel.fsdp_size=16",
        "training.per_device_train_batch_size=2",
        "optimization.use_fused_rmsnorm=True",
        'parallel.fsdp_modules=["model.layers.{*}", "lm_head"]',
        "training.save_async=true",
    ]
    assert split_cli_overrides(["training.steps=4", "--training.lr", "-1e-5"]) == [
        "training.steps=4",
        "training.lr=-1e-5",
    ]


@pytest.mark.parametrize("bad", [["stray"], ["--nodot", "1"], ["--a..b", "1"]])
def test_a_token_that_is_not_an_override_is_refused(bad, capsys):
    with pytest.raises(ConfigError) as err:
        split_cli_overrides(bad)
    assert err.value.issues[0][0] == bad[0]
    with pytest.raises(SystemExit) as exited:
        split_overrides(bad)
    # The exit code of every user error (argparse's, a config error's), not 1.
    assert exited.value.code == 2
    assert "unrecognised argument" in capsys.readouterr().err


def test_launch_line_overrides_reach_the_imported_config(tmp_path):
    path = tmp_path / "ms.yaml"
    path.write_text(MS, encoding="utf-8")
    cfg = load_config(path, [f"--{o}" for o in split_cli_overrides(LAUNCH)])
    assert cfg.model.model_name_or_path == "/models/other/"
    assert cfg.train_dataset.dataloader.model_extra["config"]["data_path"] == "./train-00000-of-00001.parquet"
    assert cfg.parallelism.data_parallel_shard == -1  # fsdp_size: FSDP over all ranks
    assert cfg.training.local_batch_size == 2
    assert cfg.kernels.use_fused_rmsnorm is True
    assert cfg.parallelism.fsdp_modules == ["model.layers.{*}", "lm_head"]
    assert cfg.checkpoint.async_save is True


def test_native_overrides_in_the_space_form(tmp_path):
    path = tmp_path / "native.yaml"
    path.write_text("model:\n  model_type: qwen3\n", encoding="utf-8")
    cfg = load_config(
        path,
        [f"--{o}" for o in split_cli_overrides(["--training.steps", "7", "--optimizer.betas", "0.8", "0.9"])],
    )
    assert cfg.training.steps == 7 and list(cfg.optimizer.betas) == [0.8, 0.9]


def test_train_takes_the_config_first_or_with_config():
    argv, config = _positional_config(["train", "ex.yaml", "--parallel.fsdp_size", "16"])
    assert config == "ex.yaml" and argv == ["train", "--parallel.fsdp_size", "16"]
    assert _positional_config(["train", "--config", "ex.yaml"]) == (["train", "--config", "ex.yaml"], None)
    assert _positional_config(["train", "--training.steps", "3"]) == (
        ["train", "--training.steps", "3"],
        None,
    )
    assert _positional_config(["data", "preview", "ex.yaml", "-n", "2"]) == (
        ["data", "preview", "-n", "2"],
        "ex.yaml",
    )
    assert _positional_config(["config", "validate", "ex.yaml"])[1] is None


def test_train_refuses_the_config_twice(tmp_path, capsys):
    from meshforge.cli.main import main as meshforge_main

    with pytest.raises(SystemExit):
        meshforge_main(["train", "a.yaml", "--config", "b.yaml"])
    assert "the config is given twice" in capsys.readouterr().err


def test_config_commands_take_the_launch_overrides(tmp_path, capsys):
    path = tmp_path / "ms.yaml"
    path.write_text(MS, encoding="utf-8")
    assert main(["validate", str(path), *LAUNCH, "--no-path-checks"]) == 0
    assert "fsdp_size -> parallelism.data_parallel_shard = -1" in capsys.readouterr().err
    out = tmp_path / "native.yaml"
    assert (
        main(
            [
                "import",
                str(path),
                "--parallel.fsdp_size",
                "16",
                "-o",
                str(out),
                "--optimization.use_flash_attn",
                "True",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "use_flash_attn -> kernels.use_flash_attn = True" in err
    assert load_config(out).kernels.use_flash_attn is True
    assert main(["show", str(path), "--training.max_steps", "5"]) == 0
    assert "steps: 5" in capsys.readouterr().out


def test_import_names_every_key_even_when_it_fails(tmp_path, capsys):
    path = tmp_path / "ms.yaml"
    path.write_text(MS.replace("  recompute: False\n", "  recompute: False\n  fsdp_implementation: custom\n"))
    assert main(["import", str(path)]) == 2
    err = capsys.readouterr().err
    assert "error: fsdp_implementation: not supported yet: fsdp_implementation=custom" in err
    assert "import: max_steps -> training.steps = 3" in err
