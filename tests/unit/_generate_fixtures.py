"""Tiny Hugging Face folders of each family for the generation tests, and a `meshforge generate` runner."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

COMMON = {
    "vocab_size": 8192,  # the bundled tokenizer's size
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
#: The generic-path model of the generation tests (transformers knows it, meshforge builds no family).
GENERIC = "mistral"
FAMILY_CONFIGS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "head_dim": None,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
    # Window 3 is shorter than the prompts: the sliding layer's cache keeps only its window.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
    ),
    # Half of each head rotated (partial RoPE after the width q/k norms).
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "rotary_dim": 4},
    ),
    # Not a built-in family: the generic transformers path.
    GENERIC: ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def own_only_args() -> dict[str, object]:
    """Tiny args of the cached families transformers has no causal LM for (no folder to compare).

    Their cached generation is compared with the whole-sequence one (``test_kv_cache_own.py``).
    step3p5: a full then a sliding layer (window 4, shorter than the prompts, other head counts),
    the second sparse, head-wise gates; mamba3: MIMO rank 2 with chunks of 4.
    """
    from meshforge.models.mamba3.args import Mamba3Args
    from meshforge.models.step3p5.args import Step3p5Args

    step3p5 = Step3p5Args(
        vocab_size=96,
        hidden_size=24,
        intermediate_size=40,
        num_attention_heads=4,
        num_attention_groups=2,
        num_hidden_layers=2,
        head_dim=8,
        max_position_embeddings=64,
        moe_intermediate_size=12,
        moe_num_experts=4,
        moe_top_k=2,
        share_expert_dim=16,
        moe_layers_enum="1",
        rope_theta=[10_000.0, 500.0],
        partial_rotary_factors=[0.5, 1.0],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
        attention_other_setting={"num_attention_heads": 6, "num_attention_groups": 3},
        use_head_wise_attn_gate=True,
    )
    mamba3 = Mamba3Args(
        vocab_size=96,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=8,
        head_dim=8,
        is_mimo=True,
        mimo_rank=2,
        chunk_size=4,
    )
    return {"step3p5": step3p5, "mamba3": mamba3}


PROMPTS = ["the model reads a file", "and returns", "the value of each key in order while the loader"]


def save_family(folder: Path, family: str, seed: int = 0) -> Path:
    """A random tiny model of ``family`` with the bundled tokenizer, saved as a HF folder."""
    import transformers

    from meshforge.data.tokenizer import build_tokenizer

    config_cls, model_cls, extra = FAMILY_CONFIGS[family]
    tokenizer = build_tokenizer("meshforge://assets/tokenizer")
    torch.manual_seed(seed)
    options = {k: v for k, v in {**COMMON, **extra}.items() if v is not None}
    config = getattr(transformers, config_cls)(
        **options, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param.dim() > 1:
                param.mul_(8.0)  # sharper logits: fewer near-ties between the two implementations
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_config(path: Path, model_lines: str, inference: dict | None = None) -> Path:
    text = f"context:\n  device_target: cpu\nmodel:\n{model_lines}\n"
    if inference:
        text += "inference:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in inference.items())
    path.write_text(text)
    return path


def generate(config: Path, out: Path, *, stdin: str | None = None, **kwargs) -> tuple[int, str, list[dict]]:
    """Run `meshforge generate` in this process: (exit status, printed text, output rows)."""
    from meshforge.infer.run import GenerateArgs, run_generate

    printed = io.StringIO()
    args = GenerateArgs(
        config=str(config),
        overrides=kwargs.pop("overrides", []),
        prompts=kwargs.pop("prompts", []),
        output=str(out),
        **kwargs,
    )
    rc = run_generate(args, stdin=io.StringIO(stdin or ""), stdout=printed)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if rc == 0 and out.exists() else []
    return rc, printed.getvalue(), rows


def hf_greedy(
    folder: Path, prompts: list[list[int]], max_new_tokens: int, *, use_cache: bool = True
) -> list[list[int]]:
    """transformers' generate on the folder, left-padded batch, greedy; tokens up to and including eos."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), config.pad_token_id)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=use_cache,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
    rows = []
    for row in out[:, length:].tolist():
        kept = []
        for token in row:
            kept.append(token)
            if token == config.eos_token_id:
                break
        rows.append(kept)
    return rows
