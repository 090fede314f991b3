"""Loading a checkpoint or a model folder never runs code (docs/security.md).

Each pickled file a checkpoint or model folder can hold is replaced by a pickle whose
`__reduce__` calls `os.system` to create a marker file: the RNG files, DCP's `.metadata`, a
non-tensor value in DCP's data files, a `.bin` weight file, a tokenizer with code of its own and
a Megatron index cache. Each load is refused in one line naming the file (and the global it
tried to load), and the marker never appears. Names a checkpoint or model folder gives for its
own files never point outside it. Untampered checkpoints, also with RNG files of the older
pickled format, still resume bitwise.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import meshforge_here, read_metrics, train_four_steps

ASSETS = Path(__file__).resolve().parents[2] / "assets"


class Payload:
    """What an attacker pickles: unpickling it runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _step_copy(run: Path, dest: Path) -> Path:
    """A copy of the run's step 2 folder (with the run's config.yaml two levels up), without its
    `manifest.json`: whoever crafts a file can rewrite the manifest too, so the readers must
    refuse on their own."""
    step = dest / "checkpoints" / "checkpoint-00000002"
    shutil.copytree(run / "checkpoints" / "checkpoint-00000002", step)
    (step / "manifest.json").unlink()
    shutil.copy(run / "config.yaml", dest / "config.yaml")
    return step


def _refused_line(proc: subprocess.CompletedProcess[str], marker: Path) -> str:
    """The one error line of a refused command, after checking nothing ran."""
    assert not marker.exists(), "the payload ran"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def _resume_refused(config: Path, step: Path, marker: Path) -> str:
    return _refused_line(
        train_four_steps(config, step.parents[2] / "resumed", f"--checkpoint.load_path={step}"), marker
    )


@pytest.mark.slow  # whole trainings
@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_a_crafted_rng_file_is_refused(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path, container: str
) -> None:
    config, run, _ = four_step_run
    marker = tmp_path / "ran"
    step = _step_copy(run, tmp_path / "run")
    file = step / "rng" / "rank_00000.pt"
    if container == "pickle":
        file.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"python": Payload(marker)}, file)
    line = _resume_refused(config, step, marker)
    assert (
        line
        == f"error: {file}: refused to load posix.system (a checkpoint must not carry code); do not load this folder"
    )


@pytest.mark.slow  # whole trainings
@pytest.mark.parametrize("where", ["whole file", "inside the metadata"])
def test_a_crafted_dcp_metadata_is_refused_by_resume_convert_and_generate(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path, where: str
) -> None:
    from meshforge.checkpoint.dcp_reader import read_dcp_metadata

    config, run, _ = four_step_run
    marker = tmp_path / "ran"
    step = _step_copy(run, tmp_path / "run")
    file = step / ".metadata"
    if where == "whole file":
        file.write_bytes(pickle.dumps(Payload(marker)))
    else:
        metadata = read_dcp_metadata(step)
        metadata.planner_data = Payload(marker)
        file.write_bytes(pickle.dumps(metadata))
    expected = f"{file}: refused to load posix.system (a checkpoint must not carry code)"
    assert expected in _resume_refused(config, step, marker)
    convert = meshforge_here("convert", "--to", "hf", str(step), str(tmp_path / "hf"), cwd=tmp_path)
    assert expected in _refused_line(convert, marker)
    generate = meshforge_here(
        "generate", "-c", str(config), f"--checkpoint.load_path={step}", "-p", "the", "--max-new-tokens", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert expected in _refused_line(generate, marker)


@pytest.mark.slow  # whole trainings
def test_a_crafted_value_in_the_dcp_data_is_refused(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    """The optimizer's param-group settings are pickles in the `.distcp` files (DCP's bytes items)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    config, run, _ = four_step_run
    marker = tmp_path / "ran"
    step = _step_copy(run, tmp_path / "run")
    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(step, whole)  # this test's own trusted copy, to write the crafted one from
    state = torch.load(whole, weights_only=False)
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    for data in step.glob("*.distcp"):
        data.unlink()
    (step / ".metadata").unlink()
    dcp.save(state, checkpoint_id=str(step), no_dist=True)
    line = _resume_refused(config, step, marker)
    assert line == (
        f"error: {step}: refused to load posix.system for optimizer.param_groups.0.lr "
        "(a checkpoint must not carry code); do not load this folder"
    )


@pytest.mark.slow  # whole trainings
def test_a_data_file_outside_the_checkpoint_is_refused(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    from meshforge.checkpoint.dcp_reader import read_dcp_metadata

    config, run, _ = four_step_run
    marker = tmp_path / "ran"
    step = _step_copy(run, tmp_path / "run")
    metadata = read_dcp_metadata(step)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = f"../{info.relative_path}"
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    line = _resume_refused(config, step, marker)
    assert (
        f"names the data file '../{info.relative_path[3:]}', which is not inside the checkpoint folder"
        in line
    )


@pytest.mark.slow  # whole trainings
def test_rng_files_of_the_older_pickled_format_still_resume_bitwise(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    from meshforge.checkpoint.rng_file import read_rng_file

    config, run, full = four_step_run
    step = _step_copy(run, tmp_path / "run")
    file = step / "rng" / "rank_00000.pt"
    state = read_rng_file(file)
    assert state is not None
    torch.save(dict(state), file)  # what meshforge wrote before: the RNGState dict, pickled
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
    out = tmp_path / "resumed"
    proc = train_four_steps(config, out, f"--checkpoint.load_path={step}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in full[2:]]


def test_the_rng_file_holds_only_tensors_and_text(tmp_path: Path) -> None:
    from meshforge.checkpoint.rng_file import read_rng_file, write_rng_file
    from meshforge.utils.seed import rng_state

    state = rng_state()
    write_rng_file(tmp_path / "rng.pt", state)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "rng.pt")) == []
    payload = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert {type(value) for value in payload.values()} == {str, torch.Tensor}
    back = read_rng_file(tmp_path / "rng.pt")
    assert back is not None
    assert back["python"] == state["python"]
    assert back["numpy"][0] == state["numpy"][0] and back["numpy"][2:] == state["numpy"][2:]
    assert (back["numpy"][1] == state["numpy"][1]).all() and back["numpy"][1].dtype == state["numpy"][1].dtype
    assert torch.equal(back["torch_cpu"], state["torch_cpu"])


@pytest.mark.slow  # whole trainings
def test_a_run_folders_own_config_cannot_turn_on_remote_code(
    four_step_run: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    _, run, _ = four_step_run
    step = _step_copy(run, tmp_path / "run")
    config = step.parents[1] / "config.yaml"
    config.write_text(config.read_text().replace("trust_remote_code: false", "trust_remote_code: true", 1))
    proc = meshforge_here("convert", "--to", "hf", str(step), str(tmp_path / "hf"), cwd=tmp_path)
    assert _refused_line(proc, tmp_path / "ran") == (
        f"error: {config}: sets model.trust_remote_code: true; a checkpoint's own config never runs a "
        "model folder's code: read it, then pass it yourself with --config"
    )


def _model_folder(dest: Path) -> Path:
    dest.mkdir()
    shutil.copy(ASSETS / "models" / "qwen3-tiny" / "config.json", dest / "config.json")
    return dest


@pytest.mark.parametrize("container", ["pickle", "torch.save"])
def test_pickled_hf_weights_are_refused(tmp_path: Path, container: str) -> None:
    marker = tmp_path / "ran"
    folder = _model_folder(tmp_path / "model")
    weights = folder / "pytorch_model.bin"
    if container == "pickle":
        weights.write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload(marker)}))
    else:
        torch.save({"model.embed_tokens.weight": Payload(marker)}, weights)
    proc = meshforge_here("convert", "--to", "dcp", str(folder), str(tmp_path / "step"), cwd=tmp_path)
    assert _refused_line(proc, marker) == (
        f"error: {folder}: its weights are pickles (pytorch_model.bin), which can carry code; meshforge "
        "reads safetensors only (model.safetensors or model.safetensors.index.json): convert them where "
        "you trust the files (transformers' save_pretrained writes safetensors)"
    )


def test_a_shard_outside_the_model_folder_is_refused(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    proc = meshforge_here("convert", "--to", "dcp", str(folder), str(tmp_path / "step"), cwd=tmp_path)
    assert _refused_line(proc, tmp_path / "ran") == (
        f"error: {index}: names the shard file '../elsewhere.safetensors', which is not inside {folder} "
        "(a model folder's files never point outside it)"
    )


def _tokenizer_with_code(dest: Path, marker: Path) -> Path:
    shutil.copytree(ASSETS / "tokenizer", dest)
    config_file = dest / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    config_file.write_text(json.dumps(config))
    (dest / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return dest


@pytest.mark.slow  # a whole training's set-up
def test_a_tokenizer_with_its_own_code_is_refused(tiny_config: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    tokenizer = _tokenizer_with_code(tmp_path / "tok", marker)
    proc = meshforge_here(
        "train", "--config", str(tiny_config), f"--training.output_dir={tmp_path / 'out'}",
        f"--model.tokenizer_name_or_path={tokenizer}",
        cwd=tmp_path,
    )  # fmt: skip
    line = _refused_line(proc, marker)
    assert line.startswith(
        f"error: {tokenizer / 'tokenizer_config.json'}: the tokenizer ships its own code ("
    )
    assert line.endswith(f"unless model.trust_remote_code: true (set it only if you trust {tokenizer})")
    # Asked for, the folder's code is the user's choice: the check lets it through.
    from meshforge.data.tokenizer import refuse_tokenizer_code

    refuse_tokenizer_code(tokenizer, trust_remote_code=True)
    assert not marker.exists()


MEGATRON = Path(__file__).resolve().parents[2] / "configs" / "qwen3" / "pretrain_megatron_tiny.yaml"
SMALL = [
    "--training.steps=1",
    "--training.local_batch_size=2",
    "--model.hidden_size=64",
    "--model.head_dim=16",
]


@pytest.mark.slow  # whole trainings
def test_a_crafted_data_cache_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    first = meshforge_here(
        "train", "--config", str(MEGATRON), f"--training.output_dir={tmp_path / 'a'}", *SMALL, cwd=tmp_path
    )
    assert first.returncode == 0, first.stdout + first.stderr
    cache = next((tmp_path / "output" / "pretrain_megatron_tiny" / "data_cache").glob("*-document_index.npy"))
    np.save(cache, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    proc = meshforge_here(
        "train", "--config", str(MEGATRON), f"--training.output_dir={tmp_path / 'b'}", *SMALL, cwd=tmp_path
    )
    assert _refused_line(proc, marker).startswith(f"error: {cache}: not an index cache meshforge writes (")


@pytest.mark.slow  # a whole training
def test_the_restricted_reader_reads_what_pickle_reads(four_step_run: tuple[Path, Path, list[dict]]) -> None:
    from meshforge.checkpoint.dcp_reader import read_dcp_metadata

    _, run, _ = four_step_run
    step = run / "checkpoints" / "checkpoint-00000004"
    with (step / ".metadata").open("rb") as file:
        trusted = pickle.load(file)  # this test's own checkpoint
    assert read_dcp_metadata(step) == trusted


def test_a_pickle_that_changes_an_allowed_class_is_refused(tmp_path: Path) -> None:
    """`BUILD` on a class itself would change that class for the whole process."""
    from torch.distributed.checkpoint.metadata import Metadata

    from meshforge.checkpoint.dcp_reader import read_metadata_file

    file = tmp_path / ".metadata"
    # Protocol 0: push the class, then set its attribute `x` through BUILD's slot state.
    file.write_bytes(b"ctorch.distributed.checkpoint.metadata\nMetadata\n(N(dS'x'\nI1\nstb.")
    with pytest.raises(ValueError) as refused:
        read_metadata_file(file)
    assert str(refused.value) == (
        f"{file}: refused to load a state set on Metadata (a checkpoint must not carry code); do not load this folder"
    )
    assert not hasattr(Metadata, "x")
