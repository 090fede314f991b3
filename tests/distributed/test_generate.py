"""FSDP-sharded `meshforge generate` (torchrun, 2 processes) gives the tokens of one process.

Both backends: meshforge's cached decoder on a built-in family (greedy, and seeded sampling, where
rank 0's choice is broadcast so the ranks cannot diverge), and transformers' generate on the
generic path (``synced_gpus`` keeps the ranks' forwards matched); beam search on qwen3_next.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import meshforge_cmd, worker_env
from tests.unit._generate_fixtures import PROMPTS, generate, save_family, write_config

pytest.importorskip("transformers")

CASES = {
    "qwen3_moe-meshforge-greedy": ("qwen3_moe", {"infer_backend": "meshforge"}),
    "llama-meshforge-sampled": (
        "llama",
        {"infer_backend": "meshforge", "do_sample": True, "temperature": 1.2, "top_k": 50, "seed": 7},
    ),
    "mistral-huggingface-greedy": ("mistral", {"infer_backend": "huggingface"}),
    # Beam search over Gated DeltaNet states and KV: the reordered caches agree across ranks.
    "qwen3_next-meshforge-beams": ("qwen3_next", {"infer_backend": "meshforge", "num_beams": 3}),
    # Weights from a DCP step folder (checkpoint.load_path), read by both ranks before sharding.
    "qwen3-dcp-meshforge-greedy": ("qwen3", {"infer_backend": "meshforge"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_process_sharded_generation_equals_one_process(case: str, tmp_path: Path) -> None:
    family, inference = CASES[case]
    folder = save_family(tmp_path / family, family)
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {**inference, "max_new_tokens": 8, "batch_size": 2},
    )
    rc, _, single = generate(config, tmp_path / "one.jsonl", prompts=PROMPTS)
    assert rc == 0
    out = tmp_path / "two.jsonl"
    cmd = meshforge_cmd("generate", "--config", str(config), "--output", str(out), nproc=2)
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    env = worker_env()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    sharded = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in sharded] == [r["token_ids"] for r in single]
    assert "weights sharded over 2 ranks" in proc.stdout
    assert "batch 2/2" in proc.stdout  # progress over the two batches
