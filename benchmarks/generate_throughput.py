"""Generation tokens/s: meshforge's cached decoder vs transformers' generate, same model and prompts.

Both sides get one model's weights (transformers builds it, meshforge loads the folder it saves; a
family of ``--family``: qwen3, gpt_oss, qwen3_next, deepseek_v3), the same batch of random prompts (equal lengths, so no padding: batch 1 and 8 measure the
decoder, not the padding rule) and greedy decoding for a fixed number of new tokens (no eos). The
runs alternate one by one (order flipped each repeat); ``ratio`` is total generated tokens/s,
ours / theirs, ``ratio_median_of_pairs`` the median of neighbouring runs' ratios and
``ratio_of_fastest`` the ratio of each side's fastest run. The tokens of
the two sides are compared (``same_tokens``), which checks that they do the same work.
``--num-beams N`` times beam search on both sides instead of greedy decoding. For deepseek_v3 the
line also gives the bytes per token of meshforge's cache with the compressed MLA latent and with
full per-head keys/values (``--mla-cache full`` times the latter).

    .venv/bin/python benchmarks/generate_throughput.py                 # batch 1 and 8, CPU
    .venv/bin/python benchmarks/generate_throughput.py --quick
    .venv/bin/python benchmarks/generate_throughput.py --family qwen3_next --num-beams 4
    .venv/bin/python benchmarks/generate_throughput.py --device cuda --dtype bfloat16 --shape medium
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _harness import emit

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


# What each family adds to the shape's common keys (transformers' config names).
FAMILY_EXTRAS: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", {}),
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 32, "attention_bias": True},
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "full_attention_interval": 4,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "head_dim": None,
            "kv_lora_rank": 64,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
}


def build_pair(shape: str, device: torch.device, dtype: torch.dtype, family_name: str = "qwen3"):
    import tempfile

    import transformers

    from meshforge.checkpoint.hf import hf_adapter, load_hf_weights
    from meshforge.models.registry import resolve_family

    config_cls, extra = FAMILY_EXTRAS[family_name]
    options = {k: v for k, v in {**SHAPES[shape], **extra}.items() if v is not None}
    if family_name == "deepseek_v3":
        options["num_key_value_heads"] = options["num_attention_heads"]
    config = getattr(transformers, config_cls)(
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **options,
    )
    torch.manual_seed(0)
    # gpt-oss' sinks have no SDPA path in transformers: its eager attention (meshforge's is explicit too).
    attention = "eager" if family_name == "gpt_oss" else "sdpa"
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    theirs = theirs.to(device, dtype).eval()
    family = resolve_family(family_name, None, None)
    with torch.device("meta"):
        ours = family.build(hf_adapter(family).from_hf_config(config.to_dict()))
    ours.to_empty(device=device)
    ours.to(dtype)
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        load_hf_weights(ours, family, folder, log=lambda _m: None)
    return ours.eval(), theirs


def cache_bytes_per_token(model, prompts: torch.Tensor, new: int) -> dict[str, float]:
    """Bytes per token of meshforge's cache after ``new`` steps: compressed MLA latent vs full K/V."""
    from meshforge.infer.engine import DecodeRequest, Stepper

    out = {}
    for compressed in (True, False):
        request = DecodeRequest(prompts.tolist(), new, 0, (), compressed_mla=compressed)
        stepper = Stepper(model, prompts, torch.ones_like(prompts, dtype=torch.bool), request)
        with torch.no_grad():
            for _ in range(new):
                stepper.append(stepper.logits().argmax(-1))
        assert stepper.cache is not None
        tokens = prompts.shape[0] * stepper.cache.capacity
        out["compressed" if compressed else "full"] = stepper.cache.nbytes() / tokens
    return out


def run_ours(
    model, prompts: torch.Tensor, new: int, beams: int = 1, compressed: bool = True
) -> list[list[int]]:
    from meshforge.infer.beam import BeamOptions, beam_search
    from meshforge.infer.engine import DecodeRequest, decode
    from meshforge.infer.sampling import SamplingOptions

    request = DecodeRequest(
        prompts.tolist(), new, pad_token_id=0, eos_token_ids=(), compressed_mla=compressed
    )
    if beams > 1:
        return beam_search(model, request, BeamOptions(beams))
    return decode(model, request, SamplingOptions())


@torch.no_grad()
def run_theirs(model, prompts: torch.Tensor, new: int, beams: int = 1) -> list[list[int]]:
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=beams,
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
    compressed = args.mla_cache == "compressed"
    runners = {
        "ours": lambda: run_ours(ours, prompts, args.new_tokens, args.num_beams, compressed),
        "theirs": lambda: run_theirs(theirs, prompts, args.new_tokens, args.num_beams),
    }
    same = runners["ours"]() == runners["theirs"]()
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
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
    extra = {}
    if args.family == "deepseek_v3":
        extra = {f"cache_bytes_per_token_{k}": v for k, v in cache_bytes_per_token(ours, prompts, 4).items()}
    return {
        "family": args.family,
        "num_beams": args.num_beams,
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
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="small")
    parser.add_argument("--family", choices=list(FAMILY_EXTRAS), default="qwen3")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams")
    parser.add_argument("--mla-cache", choices=["compressed", "full"], default="compressed")
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
    ours, theirs = build_pair(args.shape, device, getattr(torch, args.dtype), args.family)
    for batch in args.batches:
        emit(bench(args, batch, ours, theirs, device))


if __name__ == "__main__":
    main()
