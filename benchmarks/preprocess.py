"""Megatron data path: preprocess throughput, GPTDataset index build and reads, loader samples/s.

Cases (one JSON line each; ratios are ours over the reference measured in the same process):

* ``preprocess``: `meshforge preprocess` (the library call, workers=1 and --workers N) on the
  bundled docstring corpus repeated ``--repeat`` times, against the same tokenizer's raw batch
  encode (`tokenizer(texts[k:k+1000])`) of the same texts. Target ratio >= 0.8.
* ``index_build``: document, sample and shuffle indices for 10M and 100M tokens (random document
  lengths 50..2000, seq_length 1024, one epoch), ours (numpy) against megatron-core 0.16's
  (`_build_document_index`, compiled `helpers.build_sample_idx`, `_build_shuffle_index`); median of
  5 alternating runs; the arrays are checked equal. Target: ours <= 1.5x its time at 100M.
* ``reads``: random `GPTDataset` samples/s over the 10M-token corpus, ours `sample(i)` (Megatron's
  dict) and `contract_sample(i)` (the batch contract) against megatron-core's `GPTDataset[i]`.
  Target: ours >= its rate.
* ``loader``: `StatefulLoader` over the GPTDataset of the same 10M-token corpus (seq 1024): batches/s,
  samples/s and tokens/s of `next(loader)` (CPU `torch.long` tensors in the batch contract) at local
  batch 8 and 16, in the dataset's order and reshuffled by the loader, with and without document
  separation (`reset_attention_mask`: `segment_ids`), against the dataset's own `get_batch` of the
  same indices (``overhead`` = loader time / get_batch time; the loader adds the index order and
  the numpy -> torch conversion). ``resume_ms``: `load_state_dict` to the last batch of the epoch
  plus the first `next()` after it (O(1): no batch before it is read).

Needs megatron-core (the dev extra) for the reference sides of ``index_build`` and ``reads``; the
``loader`` case runs without it. Run:
``python benchmarks/preprocess.py [--repeat 5] [--workers 2] [--skip-100m] [--cases loader,reads]``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from _harness import emit

from meshforge.data.megatron.gpt_dataset import GPTDataset, GPTDatasetConfig, build_indices
from meshforge.data.megatron.indexed import IndexedDataset, IndexedDatasetWriter
from meshforge.data.megatron.preprocess import PreprocessOptions, preprocess
from meshforge.data.tokenizer import build_tokenizer
from meshforge.utils.resources import resolve_path

TOKENIZER = "meshforge://assets/tokenizer"
SEQ = 1024
CASES = ("preprocess", "index_build", "reads", "loader")


def bench_preprocess(tmp: Path, repeat: int, workers: int) -> None:
    corpus = resolve_path("meshforge://assets/corpus/python_docstrings.jsonl").read_text(encoding="utf-8")
    src = tmp / "corpus.jsonl"
    src.write_text(corpus * repeat, encoding="utf-8")
    texts = [json.loads(line)["text"] for line in src.read_text(encoding="utf-8").splitlines()]
    tok = build_tokenizer(TOKENIZER)
    mb = src.stat().st_size / 1e6
    for n in sorted({1, workers}):
        start = time.perf_counter()
        for k in range(0, len(texts), 1000):
            tok(texts[k : k + 1000], return_attention_mask=False, verbose=False)
        raw = time.perf_counter() - start
        start = time.perf_counter()
        options = PreprocessOptions(
            input=str(src), output_prefix=str(tmp / f"pp{n}"), tokenizer=TOKENIZER, append_eod=True, workers=n
        )
        summary = preprocess(options, out=io.StringIO())
        ours = time.perf_counter() - start
        emit(
            dict(
                case="preprocess",
                workers=n,
                megabytes=round(mb, 2),
                documents=summary.documents,
                raw_encode_s=round(raw, 3),
                preprocess_s=round(ours, 3),
                preprocess_mb_per_s=round(mb / ours, 2),
                docs_per_s=round(summary.documents / ours),
                ratio=round(raw / ours, 3),
                target=">= 0.8",
            )
        )


def _lengths(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2000, tokens // 1000 + 16).astype(np.int32)
    return lengths[: int(np.searchsorted(np.cumsum(lengths), tokens))]


def _megatron_build(sizes: np.ndarray, docs: np.ndarray, num_samples: int, seed: int):
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    rng = np.random.RandomState(seed)
    doc_index = _build_document_index(docs, 1, rng, False)
    sample_index = helpers.build_sample_idx(sizes, doc_index, SEQ, 1, int(sizes[docs].sum()), True, True)
    n = sample_index.shape[0] - 1
    return doc_index, sample_index, _build_shuffle_index(n, n, rng)


def bench_index_build(sizes_m: list[int]) -> None:
    for millions in sizes_m:
        sizes = _lengths(millions * 1_000_000)
        docs = np.arange(len(sizes), dtype=np.int32)
        num_samples = (int(sizes.sum()) - 1) // SEQ
        cfg = GPTDatasetConfig(seq_length=SEQ, seed=1234)
        ours_t, theirs_t = [], []
        for rep in range(5):
            for side in ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours"):
                start = time.perf_counter()
                if side == "ours":
                    ours = build_indices(sizes, docs, num_samples, cfg)
                    ours_t.append(time.perf_counter() - start)
                else:
                    theirs = _megatron_build(sizes, docs, num_samples, 1234)
                    theirs_t.append(time.perf_counter() - start)
        equal = all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        o, t = statistics.median(ours_t), statistics.median(theirs_t)
        emit(
            dict(
                case="index_build",
                tokens=int(sizes.sum()),
                samples=num_samples,
                ours_s=round(o, 4),
                megatron_core_s=round(t, 4),
                time_ratio=round(o / t, 2),
                identical=equal,
                target="<= 1.5 at 100M tokens",
            )
        )


def _reads_corpus(tmp: Path) -> tuple[Path, int]:
    """A 10M-token indexed corpus (random tokens, document lengths 50..2000, EOD 0 ending each one)."""
    prefix = tmp / "reads_text_document"
    sizes = _lengths(10_000_000, seed=1)
    if not prefix.with_suffix(".idx").exists():
        rng = np.random.default_rng(2)
        tokens = rng.integers(1, 60000, int(sizes.sum()))
        tokens[np.cumsum(sizes) - 1] = 0  # each document ends with EOD, as preprocess --append-eod writes
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_documents(tokens, sizes, np.ones(len(sizes), dtype=np.int64))
    return prefix, (int(sizes.sum()) - 1) // SEQ


def bench_loader(tmp: Path, batches: tuple[int, ...] = (8, 16), steps: int = 200) -> None:
    """StatefulLoader over the GPTDataset (see the module docstring); no megatron-core needed."""
    from meshforge.data.loader import StatefulLoader

    prefix, num = _reads_corpus(tmp)
    ds = IndexedDataset(prefix)
    for separate in (False, True):
        cfg = GPTDatasetConfig(
            seq_length=SEQ, seed=1, eod=0, reset_attention_mask=separate, path_to_cache=str(tmp / "lcache")
        )
        gpt = GPTDataset(ds, np.arange(len(ds), dtype=np.int32), num, cfg)
        for lbs in batches:
            for shuffle in (False, True):
                loader = StatefulLoader(
                    gpt, local_batch_size=lbs, dp_rank=0, dp_size=1, seed=0, shuffle=shuffle
                )
                for _ in range(3):
                    next(loader)
                # the same index sets the loader reads next, for the dataset-only side
                order = np.random.default_rng([0, 0]).permutation(num) if shuffle else np.arange(num)
                start_pos = loader.position
                index_sets = [order[start_pos + k * lbs : start_pos + (k + 1) * lbs] for k in range(steps)]
                loader_t, direct_t = [], []
                blocks = 10
                # alternate the two sides in blocks (order flipped every block) so that the shared
                # machine's noise hits both; rates are medians over blocks
                for block in range(blocks):
                    chunk = index_sets[block * steps // blocks : (block + 1) * steps // blocks]
                    for side in ("loader", "direct") if block % 2 == 0 else ("direct", "loader"):
                        t0 = time.perf_counter()
                        if side == "loader":
                            for _ in chunk:
                                batch = next(loader)
                            loader_t.append((time.perf_counter() - t0) / len(chunk))
                        else:
                            for idx in chunk:
                                gpt.get_batch(idx)
                            direct_t.append((time.perf_counter() - t0) / len(chunk))
                keys = {"input_ids", "labels", "position_ids"} | ({"segment_ids"} if separate else set())
                assert set(batch) == keys
                per_batch = statistics.median(loader_t)
                overhead = statistics.median(a / b for a, b in zip(loader_t, direct_t, strict=True))
                t0 = time.perf_counter()
                state = loader.state_dict()
                state["position"] = loader.used_per_epoch - lbs
                loader.load_state_dict(state)
                next(loader)
                resume_ms = (time.perf_counter() - t0) * 1e3
                emit(
                    dict(
                        case="loader",
                        batch=f"{lbs} x {SEQ}",
                        shuffle=shuffle,
                        segment_ids=separate,
                        batches_per_s=round(1 / per_batch, 1),
                        samples_per_s=round(lbs / per_batch),
                        tokens_per_s=round(lbs * SEQ / per_batch),
                        get_batch_samples_per_s=round(lbs / statistics.median(direct_t)),
                        overhead=round(overhead, 3),
                        resume_ms=round(resume_ms, 2),
                    )
                )


def bench_reads(tmp: Path) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronConfig

    prefix, num = _reads_corpus(tmp)

    class Tok:
        eod, pad, vocab_size = 0, -1, 65535
        unique_identifiers = {"class": "bench"}

    mcfg = MegatronConfig(
        random_seed=1,
        sequence_length=SEQ,
        blend=([str(prefix)], None),
        split="1,0,0",
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(tmp / "mcache"),
    )
    [theirs, _, _] = BlendedMegatronDatasetBuilder(MegatronGPT, [num, 0, 0], lambda: True, mcfg).build()
    ds = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(seq_length=SEQ, seed=1, eod=0, path_to_cache=str(tmp / "ocache"))
    ours = GPTDataset(ds, np.arange(len(ds), dtype=np.int32), num, cfg)
    picks = np.random.default_rng(3).integers(0, num, 4000)
    rates: dict[str, list[float]] = {"megatron_core": [], "ours_sample": [], "ours_contract": []}
    calls = {
        "megatron_core": lambda i: theirs[int(i)],
        "ours_sample": lambda i: ours.sample(int(i)),
        "ours_contract": lambda i: ours.contract_sample(int(i)),
    }
    for chunk in np.array_split(picks, 8):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in chunk:
                call(i)
            rates[name].append(len(chunk) / (time.perf_counter() - start))
    med = {k: statistics.median(v) for k, v in rates.items()}
    emit(
        dict(
            case="reads",
            samples_per_s={k: round(v) for k, v in med.items()},
            ratio_sample=round(med["ours_sample"] / med["megatron_core"], 2),
            ratio_contract=round(med["ours_contract"] / med["megatron_core"], 2),
            target=">= 1.0",
        )
    )
    _loader_vs_torch(ours, theirs)


def _loader_vs_torch(ours: GPTDataset, theirs, lbs: int = 8, steps: int = 200) -> None:
    """Our StatefulLoader vs what a Megatron user runs: torch DataLoader over megatron-core's GPTDataset.

    Same corpus, seq, batch and in-order reading (MegatronPretrainingSampler is sequential), no
    worker processes on either side (the loader's unit is one process's micro-batches).
    """
    import torch

    from meshforge.data.loader import StatefulLoader

    ours_loader = StatefulLoader(ours, local_batch_size=lbs, dp_rank=0, dp_size=1, seed=0, shuffle=False)
    theirs_iter = iter(torch.utils.data.DataLoader(theirs, batch_size=lbs, shuffle=False, num_workers=0))
    for _ in range(3):
        next(ours_loader), next(theirs_iter)
    times: dict[str, list[float]] = {"ours": [], "torch_dataloader_megatron_core": []}
    blocks = 10
    for block in range(blocks):
        names = list(times) if block % 2 == 0 else list(times)[::-1]
        for name in names:
            it = ours_loader if name == "ours" else theirs_iter
            t0 = time.perf_counter()
            for _ in range(steps // blocks):
                next(it)
            times[name].append((time.perf_counter() - t0) / (steps // blocks))
    med = {k: statistics.median(v) for k, v in times.items()}
    emit(
        dict(
            case="loader_vs_megatron",
            batch=f"{lbs} x {SEQ}",
            samples_per_s={k: round(lbs / v) for k, v in med.items()},
            ratio=round(med["torch_dataloader_megatron_core"] / med["ours"], 2),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="Copies of the 2.2 MB corpus to preprocess.")
    parser.add_argument(
        "--workers", type=int, default=2, help="Worker processes for the second preprocess run."
    )
    parser.add_argument("--skip-100m", action="store_true", help="Index build at 10M tokens only.")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"Comma-separated cases to run (default all: {','.join(CASES)}).",
    )
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; valid: {', '.join(CASES)}")
    warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex/TE on import
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        if "preprocess" in cases:
            bench_preprocess(tmp, args.repeat, args.workers)
        if "index_build" in cases:
            bench_index_build([10] if args.skip_100m else [10, 100])
        if "reads" in cases:
            bench_reads(tmp)
        if "loader" in cases:
            bench_loader(tmp)


if __name__ == "__main__":
    main()
