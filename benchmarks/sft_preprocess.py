"""SFT preprocessing throughput: examples/s of the SFTDataLoader pipeline, with and without packing.

Cases (one JSON line each), on the bundled sharegpt conversations repeated ``--repeat`` times and
the ChatML template, `datasets` caching off (`overwrite_cache`), one process:

* ``unpacked`` / ``packed`` / ``neat_packed``: `build_sft_columns` end to end (load, convert, encode,
  pack), examples/s; `ratio_vs_raw_encode` divides by the rate of the same tokenizer's raw batch
  encode of the same conversations rendered as one string each (the floor any slot-wise encoder
  pays, with no per-slot calls).
* ``llamafactory``: when `llamafactory` imports (see tests/unit/test_sft_llamafactory.py), its
  `SupervisedDatasetProcessor.preprocess_dataset` on our converted examples against our encoding step
  alone (`encode_batch`) on the same examples; median of 5 alternating runs; `ratio` is ours / theirs
  in examples/s, and `same_rows` checks the ids and labels are equal.

Run: ``python benchmarks/sft_preprocess.py [--repeat 20] [--cutoff 1024]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from _harness import emit  # noqa: E402

from meshforge.config import config_from_dict  # noqa: E402
from meshforge.data.sft.converters import convert_batch  # noqa: E402
from meshforge.data.sft.dataset_info import COLUMN_DEFAULTS, TAG_DEFAULTS  # noqa: E402
from meshforge.data.sft.loader import build_sft_columns  # noqa: E402
from meshforge.data.sft.processor import encode_batch  # noqa: E402
from meshforge.data.sft.templates import get_template  # noqa: E402
from meshforge.data.tokenizer import build_tokenizer  # noqa: E402
from meshforge.utils.resources import resolve_path  # noqa: E402

TOKENIZER = "meshforge://assets/tokenizer"


def raw_encode_rate(tok, records: list[dict]) -> float:
    texts = []
    for r in records:
        texts.append(
            "".join(
                f"<|im_start|>{'user' if m['from'] == 'human' else 'assistant'}\n{m['value']}<|im_end|>\n"
                for m in r["conversations"]
            )
        )
    start = time.perf_counter()
    for k in range(0, len(texts), 1000):
        tok(texts[k : k + 1000], add_special_tokens=False, return_attention_mask=False)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="copies of the 899 bundled conversations")
    parser.add_argument("--cutoff", type=int, default=1024)
    args = parser.parse_args()
    tok = build_tokenizer(TOKENIZER)
    lines = (
        resolve_path("meshforge://assets/corpus/conversations.jsonl").read_text(encoding="utf-8").splitlines()
    )
    lines = [line for line in lines if line.strip()] * args.repeat
    records = [json.loads(line) for line in lines]
    raw = raw_encode_rate(tok, records)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "conv.jsonl"
        data.write_text("\n".join(lines) + "\n")
        for case, extra in (
            ("unpacked", {}),
            ("packed", {"packing": True}),
            ("neat_packed", {"neat_packing": True}),
        ):
            cfg = config_from_dict(
                {
                    "train_dataset": {
                        "dataloader": {"type": "SFTDataLoader"},
                        "template": "chatml",
                        "dataset": {"file_name": str(data), "formatting": "sharegpt"},
                        "cutoff_len": args.cutoff,
                        "overwrite_cache": True,
                        **extra,
                    }
                }
            ).train_dataset
            start = time.perf_counter()
            rows = build_sft_columns(cfg, tok, seed=0)
            seconds = time.perf_counter() - start
            rate = len(records) / seconds
            emit(
                dict(
                    case=case,
                    examples=len(records),
                    rows=len(rows),
                    seconds=round(seconds, 3),
                    examples_per_s=round(rate),
                    raw_encode_examples_per_s=round(raw),
                    ratio_vs_raw_encode=round(rate / raw, 3),
                )
            )
    bench_llamafactory(tok, records, args.cutoff)


def bench_llamafactory(tok, records: list[dict], cutoff: int) -> None:
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    if "torchaudio" not in sys.modules:
        import importlib.machinery

        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stub
    try:
        from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
        from llamafactory.data.template import get_template_and_fix_tokenizer
        from llamafactory.hparams import DataArguments
    except ImportError as exc:
        emit(dict(case="llamafactory", skipped=f"llamafactory not importable: {exc}"))
        return
    batch = {"conversations": [r["conversations"] for r in records]}
    converted = convert_batch(
        batch, formatting="sharegpt", columns=COLUMN_DEFAULTS, tags=TAG_DEFAULTS, ranking=False
    )
    lf_batch = {k: converted[k] for k in ("_prompt", "_response", "_system", "_tools")}
    lf_batch.update({k: [None] * len(records) for k in ("_images", "_videos", "_audios")})
    lf_tok = build_tokenizer(TOKENIZER)
    data_args = DataArguments(template="chatml", cutoff_len=cutoff)
    processor = SupervisedDatasetProcessor(
        template=get_template_and_fix_tokenizer(lf_tok, data_args),
        tokenizer=lf_tok,
        processor=None,
        data_args=data_args,
    )
    template = get_template("chatml", tok)
    runs = {
        "theirs": lambda: processor.preprocess_dataset(lf_batch),
        "ours": lambda: encode_batch(
            converted,
            template=template,
            tokenizer=tok,
            cutoff_len=cutoff,
            train_on_prompt=False,
            mask_history=False,
        ),
    }
    times: dict[str, list[float]] = {"theirs": [], "ours": []}
    outputs = {}
    for repeat in range(5):  # alternate, order flipped each time: the shared machine's load hits both
        for name in sorted(runs, reverse=bool(repeat % 2)):
            start = time.perf_counter()
            outputs[name] = runs[name]()
            times[name].append(time.perf_counter() - start)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    timings = {"ours": ours, "theirs": theirs}
    timings["ours_rows"], timings["theirs_rows"] = (
        len(outputs["ours"]["input_ids"]),
        len(outputs["theirs"]["input_ids"]),
    )
    emit(
        dict(
            case="llamafactory",
            examples=len(records),
            ours_examples_per_s=round(len(records) / timings["ours"]),
            theirs_examples_per_s=round(len(records) / timings["theirs"]),
            ratio=round(timings["theirs"] / timings["ours"], 3),
            same_rows=outputs["ours"]["input_ids"] == outputs["theirs"]["input_ids"]
            and outputs["ours"]["labels"] == outputs["theirs"]["labels"],
        )
    )


if __name__ == "__main__":
    main()
