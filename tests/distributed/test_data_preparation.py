"""Shared data is prepared once per job or once per node, and the other ranks read what it wrote.

Two gloo ranks stand for two nodes when both are given `LOCAL_RANK=0`, and for one node of two
ranks otherwise. Checked from each rank's own log: who tokenised or built, who loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.slow


def _as_nodes(two_nodes: bool, rank: int) -> str | None:
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0" if two_nodes else str(rank)
    return old


def _restore(old: str | None) -> None:
    if old is None:
        os.environ.pop("LOCAL_RANK", None)
    else:
        os.environ["LOCAL_RANK"] = old


def _sft_worker(rank: int, world: int, folder: str, shared_fs: bool) -> None:
    from meshforge.config import config_from_dict
    from meshforge.data.sft.loader import build_sft_data
    from meshforge.data.tokenizer import build_tokenizer

    old = _as_nodes(False, rank)
    try:
        cfg = config_from_dict(
            {
                "train_dataset": {
                    "dataloader": {"type": "SFTDataLoader"},
                    "template": "chatml",
                    "cutoff_len": 32,
                    "dataset": "a",
                    "dataset_dir": folder,
                    "tokenized_path": str(Path(folder) / f"tok-{shared_fs}"),
                    "data_shared_file_system": shared_fs,
                }
            }
        ).train_dataset
        lines: list[str] = []
        train, _ = build_sft_data(
            cfg, build_tokenizer("meshforge://assets/tokenizer"), seed=0, log=lines.append
        )
        text = "\n".join(lines)
        if rank == 0:
            assert "tokenized data saved to" in text, text
        else:
            # The second rank waited for the first and read its folder instead of tokenising.
            assert "loaded tokenized data from" in text and "saved" not in text, text
        rows = [train.row(i)["input_ids"].tolist() for i in range(len(train))]  # type: ignore[union-attr]
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, rows)
        assert gathered[0] == gathered[1]
    finally:
        _restore(old)


def test_sft_data_is_tokenised_once_and_read_by_the_other_rank(tmp_path: Path) -> None:
    rows = [{"instruction": f"q {i}", "input": "", "output": f"answer {i}"} for i in range(24)]
    (tmp_path / "a.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.json"}}))
    for shared_fs in (False, True):
        run_workers(_sft_worker, 2, str(tmp_path), shared_fs)


def _megatron_worker(
    rank: int, world: int, prefix: str, cache: str, per_node: bool, local_disks: bool
) -> None:
    from meshforge.data.build import LoaderContext, build_train_loader
    from meshforge.data.config import TrainDatasetConfig

    old = _as_nodes(True, rank)
    try:
        cfg = TrainDatasetConfig.model_validate(
            {
                "no_shared_storage": per_node,
                "dataloader": {
                    "type": "BlendedMegatronDatasetDataLoader",
                    "config": {
                        "seq_length": 16,
                        "split": "1,0,0",
                        "eod": 0,
                        "data_path": [prefix],
                        # Node-local disks: each one-rank node sees only its own folder.
                        "path_to_cache": f"{cache}/node{rank}" if local_disks else cache,
                    },
                },
            }
        )
        lines: list[str] = []
        ctx = LoaderContext(
            tokenizer=None,
            local_batch_size=2,
            dp_rank=rank,
            dp_size=world,
            seed=3,
            global_batch_size=4,
            total_steps=5,
            log=lines.append,
        )
        if local_disks and not per_node and rank == 1:
            # Rank 0 built into its own disk only: this node has no cache, and the error says why.
            with pytest.raises(FileNotFoundError, match="no_shared_storage: true"):
                build_train_loader(cfg, ctx)
            return
        build_train_loader(cfg, ctx)
        built = any("built indices" in line for line in lines)
        # Two one-rank nodes: with per-node preparation each builds its own copy, else rank 0 alone.
        assert built == (rank == 0 or per_node), lines
    finally:
        _restore(old)


def test_megatron_index_cache_built_once_per_job_or_once_per_node(tmp_path: Path) -> None:
    from meshforge.data.megatron.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    prefix = tmp_path / "corpus_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            writer.add_document(np.r_[rng.integers(1, 1000, int(rng.integers(2, 25))), 0])
    for per_node, local_disks in ((False, False), (True, True), (False, True)):
        cache = str(tmp_path / f"cache-{per_node}-{local_disks}")
        run_workers(_megatron_worker, 2, str(prefix), cache, per_node, local_disks)
