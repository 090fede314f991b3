"""FSDP-sharded `meshforge generate` on 2 ranks gives the tokens of one process.

Both backends: meshforge's cached decoder on a built-in family (greedy, and seeded sampling, where
rank 0's choice is broadcast so the ranks cannot diverge), and transformers' generate on the
generic path (``synced_gpus`` keeps the ranks' forwards matched); beam search on qwen3_next; and
weights read from a DCP step folder (checkpoint.load_path) by both ranks before sharding.

One case launches the command itself under torchrun (the launch, the environment it sets, rank 0
alone printing and writing); the others run `run_generate` on the ranks of the pool, which join
the pool's process group and leave it standing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import meshforge_cmd, worker_env
from tests.distributed._spawn import run_workers
from tests.unit._generate_fixtures import PROMPTS, generate, save_family, write_config

pytest.importorskip("transformers")

#: Launched with torchrun.
LAUNCHED = ("qwen3_moe", {"infer_backend": "meshforge"})
#: Run on the pool's ranks: case -> (family, inference section, weights from a DCP step folder).
POOLED: dict[str, tuple[str, dict[str, object], bool]] = {
    "llama-meshforge-sampled": (
        "llama",
        {"infer_backend": "meshforge", "do_sample": True, "temperature": 1.2, "top_k": 50, "seed": 7},
        False,
    ),
    "mistral-huggingface-greedy": ("mistral", {"infer_backend": "huggingface"}, False),
    # Beam search over Gated DeltaNet states and KV: the reordered caches agree across ranks.
    "qwen3_next-meshforge-beams": ("qwen3_next", {"infer_backend": "meshforge", "num_beams": 3}, False),
    "qwen3-dcp-meshforge-greedy": ("qwen3", {"infer_backend": "meshforge"}, True),
}


def _config(tmp_path: Path, family: str, inference: dict[str, object], *, dcp: bool = False) -> Path:
    folder = save_family(tmp_path / family, family)
    settings = {**inference, "max_new_tokens": 8, "batch_size": 2}
    if not dcp:
        return write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folder}", settings)
    import yaml

    from meshforge.cli.convert import hf_to_dcp

    step = hf_to_dcp(folder, tmp_path / "step", log=lambda _m: None)
    model = yaml.safe_load((step / "model.yaml").read_text())["model"]
    lines = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in model.items())
    config = write_config(tmp_path / "gen.yaml", lines + f"  tokenizer_name_or_path: {folder}", settings)
    config.write_text(config.read_text() + f"checkpoint:\n  load_path: {step}\n")
    return config


def _check(printed: str, sharded: list[dict], single: list[dict]) -> None:
    assert [r["token_ids"] for r in sharded] == [r["token_ids"] for r in single]
    assert "weights sharded over 2 ranks" in printed
    assert "batch 2/2" in printed  # progress over the two batches


@pytest.mark.slow
def test_torchrun_launched_generation_equals_one_process(tmp_path: Path) -> None:
    config = _config(tmp_path, *LAUNCHED)
    rc, _, single = generate(config, tmp_path / "one.jsonl", prompts=PROMPTS)
    assert rc == 0
    out = tmp_path / "two.jsonl"
    cmd = meshforge_cmd("generate", "--config", str(config), "--output", str(out), nproc=2)
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    _check(proc.stdout, [json.loads(line) for line in out.read_text().splitlines()], single)


def _generate_on_ranks(rank: int, world: int, config: str, out: str) -> tuple[int, str]:
    """A worker: `meshforge generate` on this rank; (exit status, what it printed)."""
    from meshforge.infer.run import GenerateArgs, run_generate

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    printed = io.StringIO()
    args = GenerateArgs(config=config, overrides=[], prompts=list(PROMPTS), output=out)
    with contextlib.redirect_stdout(printed):
        rc = run_generate(args, stdin=io.StringIO(""), stdout=printed)
    return rc, printed.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(POOLED))
def test_two_rank_sharded_generation_equals_one_process(case: str, tmp_path: Path) -> None:
    family, inference, dcp = POOLED[case]
    config = _config(tmp_path, family, inference, dcp=dcp)
    rc, _, single = generate(config, tmp_path / "one.jsonl", prompts=PROMPTS)
    assert rc == 0
    out = tmp_path / "two.jsonl"
    (rc0, printed), (rc1, _) = run_workers(_generate_on_ranks, 2, str(config), str(out))
    assert (rc0, rc1) == (0, 0), printed
    _check(printed, [json.loads(line) for line in out.read_text().splitlines()], single)
