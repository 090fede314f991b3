"""A checkpoint of another model is refused in one line before any tensor is read.

Another size (a shape differs) used to end in DCP's size error deep in the read; another family
with the same sizes (llama has no q_norm/k_norm) used to load the shared names silently and say
"resumed". Both now name the checkpoint and the first difference. The same model still resumes,
and `no_load_optim` still loads its weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._process_group import leave_no_process_group  # noqa: F401 (a fixture)
from tests.conftest import read_metrics, train_here

pytestmark = [pytest.mark.usefixtures("leave_no_process_group"), pytest.mark.slow]


@pytest.fixture
def saved(tiny_config: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    train_here(tiny_config, ["--training.steps=2", f"--training.output_dir={run}"])
    return run / "checkpoints"


@pytest.mark.parametrize(
    ("change", "first"),
    [
        (
            ["--model.intermediate_size=96"],
            "model.intermediate_size is 128 there and 96 here "
            "(model.layers.0.mlp.down_proj.weight is [64, 128] there and [64, 96] here",
        ),
        (
            ["--model.model_type=llama", "--model.head_dim=null"],
            "it holds a qwen3 model and this run builds llama (",
        ),
    ],
    ids=["other-size", "other-family"],
)
def test_another_models_checkpoint_is_refused(
    tiny_config: Path, tmp_path: Path, saved: Path, change: list[str], first: str
) -> None:
    out = [f"--training.output_dir={tmp_path / 'other'}", "--training.steps=3"]
    for optim in ([], ["--checkpoint.no_load_optim=true"]):
        with pytest.raises(ValueError) as refused:
            train_here(tiny_config, [*out, *change, *optim, f"--checkpoint.load_path={saved}"])
        message = str(refused.value)
        assert message.startswith(
            f"checkpoint.load_path: {saved / 'checkpoint-00000002'} holds another model: "
        )
        assert first in message and str(saved.parent / "config.yaml") in message


def test_a_checkpoint_records_the_model_it_holds(saved: Path) -> None:
    import json

    record = json.loads((saved / "checkpoint-00000002" / "trainer_state.json").read_text())["model"]
    assert record["family"] == "qwen3"
    assert record["config"]["hidden_size"] == 64 and "max_position_embeddings" not in record["config"]
    assert len(record["fingerprint"]) == 16


def test_an_older_checkpoint_without_the_record_is_still_checked(
    tiny_config: Path, tmp_path: Path, saved: Path
) -> None:
    import json

    state = saved / "checkpoint-00000002" / "trainer_state.json"
    payload = json.loads(state.read_text())
    del payload["model"]
    state.write_text(json.dumps(payload))
    (state.parent / "manifest.json").unlink()  # older checkpoints have neither the record nor a manifest
    with pytest.raises(ValueError, match=r"holds another model: model\.layers\.0\.mlp\.down_proj\.weight is"):
        train_here(
            tiny_config,
            [
                f"--training.output_dir={tmp_path / 'o'}",
                "--model.intermediate_size=96",
                f"--checkpoint.load_path={saved}",
            ],
        )


def test_the_same_model_resumes_and_loads_weights_only(
    tiny_config: Path, tmp_path: Path, saved: Path
) -> None:
    resumed = tmp_path / "resumed"
    train_here(tiny_config, [f"--training.output_dir={resumed}", f"--checkpoint.load_path={saved}"])
    assert [r["step"] for r in read_metrics(resumed)] == [3, 4]
    weights = tmp_path / "weights"
    args = [f"--training.output_dir={weights}", "--training.steps=1", "--checkpoint.no_load_optim=true"]
    train_here(tiny_config, [*args, f"--checkpoint.load_path={saved}"])
    assert [r["step"] for r in read_metrics(weights)] == [1]
