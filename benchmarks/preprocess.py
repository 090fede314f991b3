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
* ``loader``: micro-batches of 16 x 1024 through `StatefulLoader` (CPU tensors), samples/s.

Needs megatron-core (the dev extra) for the reference sides. Run:
``python benchmarks/preprocess.py [--repeat 5] [--workers 2] [--skip-100m]``.
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

from meshforge.data.megatron.gpt_dataset import GPTDataset, GPTDatasetConfig, build_indices
from meshforge.data.megatron.indexed import IndexedDataset, IndexedDatasetWriter
from meshforge.data.megatron.preprocess import PreprocessOptions, preprocess
from meshforge.data.tokenizer import build_tokenizer
from meshforge.resources import resolve_path

TOKENIZER = "meshforge://assets/tokenizer"
SEQ = 1024


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


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
            case="index_build",
            tokens=int(sizes.sum()),
            samples=num_samples,
            ours_s=round(o, 4),
            megatron_core_s=round(t, 4),
            time_ratio=round(o / t, 2),
            identical=equal,
            target="<= 1.5 at 100M tokens",
        )


def bench_reads_and_loader(tmp: Path) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronConfig

    from meshforge.data.loader import StatefulLoader

    sizes = _lengths(10_000_000, seed=1)
    prefix = tmp / "reads_text_document"
    rng = np.random.default_rng(2)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(rng.integers(1, 60000, int(sizes.sum())), sizes, np.ones(len(sizes), dtype=np.int64))
    num = (int(sizes.sum()) - 1) // SEQ

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
        case="reads",
        samples_per_s={k: round(v) for k, v in med.items()},
        ratio_sample=round(med["ours_sample"] / med["megatron_core"], 2),
        ratio_contract=round(med["ours_contract"] / med["megatron_core"], 2),
        target=">= 1.0",
    )
    loader = StatefulLoader(ours, local_batch_size=16, dp_rank=0, dp_size=1, seed=0, shuffle=False)
    next(loader)
    start = time.perf_counter()
    steps = 100
    for _ in range(steps):
        next(loader)
    emit(case="loader", batch="16 x 1024", samples_per_s=round(steps * 16 / (time.perf_counter() - start)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="Copies of the 2.2 MB corpus to preprocess.")
    parser.add_argument(
        "--workers", type=int, default=2, help="Worker processes for the second preprocess run."
    )
    parser.add_argument("--skip-100m", action="store_true", help="Index build at 10M tokens only.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # megatron-core warns about missing Apex/TE on import
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        bench_preprocess(tmp, args.repeat, args.workers)
        bench_index_build([10] if args.skip_100m else [10, 100])
        bench_reads_and_loader(tmp)


if __name__ == "__main__":
    main()
