"""Families transformers has no model for (mamba3, step3p5) generate with meshforge's own decoder.

mamba3 keeps each mixer's recurrent state (``inference.use_kv_cache``, the default) or runs the
whole left-padded sequence every step; either way the padding is its own document, so the state
starts fresh at each prompt's first token and a batched prompt gives the tokens it gives alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.conftest import REPO, write_corpus
from tests.unit._generate_fixtures import PROMPTS, generate


@pytest.fixture(scope="module")
def mamba3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import train_here

    root = tmp_path_factory.mktemp("mamba3")
    corpus = write_corpus(root / "corpus.jsonl")
    train_here(
        REPO / "configs" / "mamba3" / "tiny.yaml",
        [
            "--training.steps=1",
            "--training.local_batch_size=1",
            "--training.global_batch_size=1",
            "--train_dataset.dataloader.seq_length=32",
            f"--train_dataset.dataloader.data_path={corpus}",
            f"--training.output_dir={root}",
        ],
    )
    return root


@pytest.mark.parametrize(
    ("backend", "cache"), [("huggingface", True), ("meshforge", True), ("meshforge", False)]
)
def test_mamba3_generates_batched_like_alone(
    mamba3_run: Path, backend: str, cache: bool, tmp_path: Path
) -> None:
    config = mamba3_run / "config.yaml"
    overrides = [
        f"--checkpoint.load_path={mamba3_run}",
        f"--inference.infer_backend={backend}",
        "--inference.max_new_tokens=5",
        f"--inference.batch_size={len(PROMPTS)}",
        f"--inference.use_kv_cache={str(cache).lower()}",
    ]
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("meshforge.generate")
    logger.addHandler(handler)
    try:
        rc, printed, batched = generate(
            config, tmp_path / "batched.jsonl", prompts=PROMPTS, overrides=overrides
        )
    finally:
        logger.removeHandler(handler)
    assert rc == 0, printed
    said = "\n".join(seen)
    assert "has no meshforge KV cache" not in said
    if backend == "huggingface":
        assert "transformers has no mamba3 model; meshforge's decoder generates" in said
    for prompt, row in zip(PROMPTS, batched, strict=True):
        rc, printed, alone = generate(config, tmp_path / "alone.jsonl", prompts=[prompt], overrides=overrides)
        assert rc == 0, printed
        assert alone[0]["token_ids"] == row["token_ids"], prompt
        assert len(row["token_ids"]) == 5
