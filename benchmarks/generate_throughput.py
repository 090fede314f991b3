"""Greedy generation tokens/s: meshforge's cached decoder vs transformers' generate, same model and prompts.

Both sides get one Qwen3 model's weights (transformers builds it, meshforge loads the same state
dict), the same batch of random prompts (equal lengths, so no padding: batch 1 and 8 measure the
decoder, not the padding rule) and greedy decoding for a fixed number of new tokens (no eos). The
runs alternate one by one (order flipped each repeat); ``ratio`` is total generated tokens/s,
ours / theirs, ``ratio_median_of_pairs`` the median of neighbouring runs' ratios and
``ratio_of_fastest`` the ratio of each side's fastest run. The tokens of
the two sides are compared (``same_tokens``), which checks that they do the same work.

    .venv/bin/python benchmarks/generate_throughput.py                 # batch 1 and 8, CPU
    .venv/bin/python benchmarks/generate_throughput.py --quick
    .venv/bin/python benchmarks/generate_throughput.py --device cuda --dtype bfloat16 --shape medium
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}


def build_pair(shape: str, device: torch.device, dtype: torch.dtype):
    import transformers

    from meshforge.checkpoint.hf import hf_adapter
    from meshforge.models.qwen3.args import Qwen3Args  # noqa: F401  (the family the adapter maps to)
    from meshforge.models.registry import resolve_family

    config = transformers.Qwen3Config(
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    theirs = (
        transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa")
        .to(device, dtype)
        .eval()
    )
    family = resolve_family("qwen3", None, None)
    options = hf_adapter(family).from_hf_config(config.to_dict())
    with torch.device("meta"):
        ours = family.build(options)
    ours.to_empty(device=device)
    ours.to(dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours.eval(), theirs


def run_ours(model, prompts: torch.Tensor, new: int) -> list[list[int]]:
    from meshforge.infer.engine import DecodeRequest, decode
    from meshforge.infer.sampling import SamplingOptions

    request = DecodeRequest(prompts.tolist(), new, pad_token_id=0, eos_token_ids=())
    return decode(model, request, SamplingOptions())


@torch.no_grad()
def run_theirs(model, prompts: torch.Tensor, new: int) -> list[list[int]]:
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, prompts.shape[1] :].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(args: argparse.Namespace, batch: int, ours, theirs, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, 8192, (batch, args.prompt_len), generator=g).to(device)
    same = run_ours(ours, prompts, args.new_tokens) == run_theirs(theirs, prompts, args.new_tokens)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    runners = {
        "ours": lambda: run_ours(ours, prompts, args.new_tokens),
        "theirs": lambda: run_theirs(theirs, prompts, args.new_tokens),
    }
    for repeat in range(args.repeats):
        order = ["ours", "theirs"] if repeat % 2 == 0 else ["theirs", "ours"]
        for name in order:
            _sync(device)
            start = time.perf_counter()
            runners[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    tokens = batch * args.new_tokens
    ours_tps = tokens * args.repeats / sum(times["ours"])
    theirs_tps = tokens * args.repeats / sum(times["theirs"])
    pairs = [t / o for o, t in zip(times["ours"], times["theirs"], strict=True)]
    return {
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "shape": args.shape,
        "device": str(device),
        "dtype": args.dtype,
        "ours_tokens_per_s": round(ours_tps, 1),
        "theirs_tokens_per_s": round(theirs_tps, 1),
        "ratio": round(ours_tps / theirs_tps, 3),
        "ratio_median_of_pairs": round(statistics.median(pairs), 3),
        # Fastest run of each side: the figure a burst of load on a shared machine disturbs least.
        "ratio_of_fastest": round(min(times["theirs"]) / min(times["ours"]), 3),
        "same_tokens": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="small")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 new tokens, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ours, theirs = build_pair(args.shape, device, getattr(torch, args.dtype))
    for batch in args.batches:
        print(json.dumps(bench(args, batch, ours, theirs, device)), flush=True)


if __name__ == "__main__":
    main()
