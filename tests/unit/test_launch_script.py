"""Launch scripts read as bash reads them, without running anything; the training line found."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.config.base import ConfigError
from meshforge.config.launch_script import is_launch_script, read_script

SCRIPT = r"""#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS=2
NODES=${NNODES_UNSET:-1}
WORLD=$(($GPUS*$NODES))
TP=${1:-"2"}
LAYERS=4  # a comment
NAME='it''s'
MODEL_ARGS="
    --num-layers ${LAYERS} \
    --hidden-size 64
"
TRAIN_ARGS=(
    --micro-batch-size 1   # per rank
    --global-batch-size $((WORLD*2))
)
TRAIN_ARGS+=(--lr 1e-4)
if [[ "$TP" == "2" ]] || [[ -z "$UNSET_X" ]]; then
    PAR="--tensor-model-parallel-size $TP --sequence-parallel"
else
    PAR="--tensor-model-parallel-size 1"
fi
mkdir -p logs
torchrun --nproc_per_node $GPUS pretrain_gpt.py \
    $MODEL_ARGS \
    "${TRAIN_ARGS[@]}" $PAR \
    --tensorboard-dir "/tmp/a b/${NAME}" \
    | tee logs/train.log
"""


def test_variables_arrays_arithmetic_quotes_and_conditions(tmp_path: Path):
    path = tmp_path / "run.sh"
    path.write_text(SCRIPT)
    line = read_script(str(path))
    assert line.entry == "pretrain_gpt.py" and line.launcher == ["torchrun", "--nproc_per_node", "2"]
    assert line.line == SCRIPT.splitlines().index("torchrun --nproc_per_node $GPUS pretrain_gpt.py \\") + 1
    assert line.flags == [
        "--num-layers", "4", "--hidden-size", "64",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--tensorboard-dir", "/tmp/a b/its",
    ]  # fmt: skip
    assert is_launch_script(path)


def test_meshforge_megatron_line_and_a_script_without_a_training_line(tmp_path: Path):
    path = tmp_path / "run"
    path.write_text("#!/bin/sh\nARGS='--lr 1'\npython -m meshforge megatron $ARGS\n")
    assert is_launch_script(path)
    line = read_script(str(path))
    assert (
        line.entry == "-m meshforge megatron" and line.flags == ["--lr", "1"] and line.launcher == ["python"]
    )
    bad = tmp_path / "bad.sh"
    bad.write_text("X=1\ntorchrun --nproc_per_node 8 evaluate.py --lr 1\necho done\n")
    with pytest.raises(ConfigError) as err:
        read_script(str(bad))
    assert "no line runs a training entry point" in str(err.value)
    assert "looked at: line 2: torchrun --nproc_per_node 8 evaluate.py --lr 1" in str(err.value)


def test_command_substitution_is_never_run(tmp_path: Path):
    path = tmp_path / "run.sh"
    path.write_text("OUT=$(touch hacked; echo x)\ntorchrun pretrain_gpt.py --save $OUT\n")
    with pytest.raises(ConfigError, match="command substitution, which is never run"):
        read_script(str(path))
    assert not (tmp_path / "hacked").exists()
