"""`model:`, `kernels:` and `lora_config:` sections (light: pydantic only).

`model:` keeps undeclared keys: they are the family's structural hyper-parameters
(`hidden_size`, `num_hidden_layers`, ...) and are checked by `meshforge.models.registry` for the
chosen family. The fields declared here are meshforge-level model settings shared by every family
and the native homes of MindSpeed ModelArguments. `kernels:` gathers the fused-kernel switches of
MindSpeed OptimizationArguments; `model.use_flash_attention` is an alias of
`kernels.use_flash_attn`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator, model_validator

from meshforge.config.base import (
    Bool,
    DtypeName,
    NonNegFloat,
    NonNegInt,
    PassthroughSection,
    PosInt,
    StrictSection,
    describe,
    rule_error,
)
from meshforge.config.layer_spec import LayerSpecList

MS_MODEL_IDS = (
    "gpt_oss",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "step35",
    "mamba3",
    "minimax_m27",
    "longcat_flash_ngram",
    "glm52",
    "deepseek_v4",
)


Dtype = DtypeName


class ModelConfig(PassthroughSection):
    """Which model to train; other keys are the family's hyper-parameters."""

    model_type: str | None = describe(None, "Model family, e.g. qwen3 (as in a HF config.json).")
    architectures: str | list[str] | None = describe(
        None, "HF architecture class name(s), e.g. Qwen3ForCausalLM."
    )
    model_id: str | None = describe(None, "MindSpeed model_id selecting a custom implementation, e.g. qwen3.")
    model_name_or_path: str | None = describe(
        None, "HF model folder (config.json and weights) to start from."
    )
    tokenizer_name_or_path: str | None = describe(
        None, "Tokenizer folder or file; defaults to model_name_or_path."
    )
    compute_dtype: Dtype = describe(
        "float32", "Compute dtype: float32, bfloat16 or float16 (aliases fp32/bf16/fp16)."
    )
    params_dtype: Dtype = describe("float32", "Dtype of the master parameters and optimizer state.")
    seq_length: PosInt | None = describe(None, "Sequence length; must equal the data's when both are given.")
    use_flash_attention: Bool | None = describe(None, "Alias of kernels.use_flash_attn.")
    init_model_with_meta_device: Bool = describe(False, "Build the model on the meta device before sharding.")
    trust_remote_code: Bool = describe(False, "Allow custom modelling code from the model folder.")
    train_from_scratch: Bool = describe(False, "Random init even when model_name_or_path has weights.")
    use_fast_tokenizer: Bool = describe(True, "Use the Rust (tokenizers) implementation.")
    resize_vocab: Bool = describe(False, "Resize embeddings and LM head to the tokenizer's vocabulary.")
    split_special_tokens: Bool = describe(False, "Split special tokens during tokenisation.")
    add_tokens: str | None = describe(None, "Comma-separated ordinary tokens added to the tokenizer.")
    add_special_tokens: str | None = describe(None, "Comma-separated special tokens added to the tokenizer.")
    new_special_tokens_config: str | None = describe(
        None, "YAML file {token: description} for semantic init of new tokens."
    )
    init_special_tokens: Literal["noise_init", "desc_init", "desc_init_w_noise"] = describe(
        "noise_init", "Initialisation of added special tokens."
    )
    model_revision: str = describe("main", "Model revision (branch, tag or commit).")
    cache_dir: str | None = describe(None, "Download cache folder.")
    hf_hub_token: str | None = describe(None, "Hugging Face Hub token.")
    ms_hub_token: str | None = describe(None, "ModelScope Hub token.")
    om_hub_token: str | None = describe(None, "Modelers Hub token.")
    quant_recipe_name: Literal["mxfp8", "tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = describe(
        None, "Low-precision training recipe: mxfp8 (MindSpeed), or torchao's float8 recipe names."
    )
    quant_apply_modules: list[str] = describe(
        ["model.layers.{*}"], "Module patterns quantised by the recipe."
    )
    quant_ignored_modules: list[str] = describe(["*lm_head", "*gate"], "Module patterns never quantised.")
    quant_converters: list[str] = describe(["quantize.linear.mx"], "Quantisation converters applied.")
    enable_fsdp_low_precision_all_gather: Bool = describe(
        True, "All-gather quantised weights in low precision."
    )
    fsdp_low_precision_all_gather_mode: Literal["on-demand", "all"] = describe(
        "on-demand", "Which weights are all-gathered in low precision."
    )

    @field_validator("model_id")
    @classmethod
    def _model_id(cls, value: str | None) -> str | None:
        if value is not None and value not in MS_MODEL_IDS:
            raise ValueError(f"must be one of {list(MS_MODEL_IDS)} or null, got {value!r}")
        return value

    def num_hidden_layers(self) -> int | None:
        """The layer count from the passthrough keys (`num_hidden_layers`, or `num_layers`)."""
        for key in ("num_hidden_layers", "num_layers"):
            value = (self.model_extra or {}).get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None


class KernelsConfig(StrictSection):
    """Fused-kernel switches (MindSpeed OptimizationArguments), plus torch.compile."""

    use_flash_attn: Bool | Literal["auto"] = describe(False, "Flash attention kernel (true, false or auto).")
    use_fused_rmsnorm: Bool | Literal["auto"] = describe(False, "Fused RMSNorm kernel.")
    use_fused_rotary_pos_emb: Bool | Literal["auto"] = describe(
        False, "Fused rotary position embedding kernel."
    )
    moe_grouped_gemm: Bool = describe(False, "Grouped GEMM for MoE experts.")
    chunk_loss_size: PosInt | None = describe(
        None, "Compute the LM loss in sequence chunks of this size to save memory."
    )
    gdn_chunk_size: PosInt = describe(64, "Chunk size of Gated DeltaNet kernels.")
    use_triton_gdn: Bool = describe(False, "Triton Gated DeltaNet kernel (exclusive with use_flash_gdn).")
    use_flash_gdn: Bool = describe(False, "Ascend C Gated DeltaNet kernel (exclusive with use_triton_gdn).")
    use_triton_rmsnormgated: Bool = describe(False, "Triton gated RMSNorm kernel.")
    use_ascend_mhc: Bool = describe(False, "Ascend multi-head compression kernel (deepseek_v4 only).")
    use_triton_swiglu_limit: Bool = describe(False, "Triton clamped SwiGLU kernel (deepseek_v4 only).")
    fix_router: Bool = describe(False, "Fix the expert assignment to balance load (performance tuning only).")
    pre_tokens: PosInt = describe(
        1048576,
        "Banded causal window on every attention layer: earlier tokens each query attends (1048576: all).",
    )
    next_tokens: NonNegInt = describe(
        0, "Later tokens each query attends: only 0 (causal) trains a causal LM; others are refused."
    )
    compile: Bool | Literal["auto"] = describe(
        "auto",
        "torch.compile each decoder layer and the loss: true, false, or auto (on CUDA/NPU; on the CPU "
        "only when the run is long enough for the compile time to pay back; the decision is logged).",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = describe(
        "inductor",
        "torch.compile backend (aot_eager and eager trace without generating kernels: for debugging).",
    )
    fused_linear_cross_entropy: Bool | Literal["auto"] = describe(
        "auto",
        "LM head and cross-entropy computed together, chunk by chunk, with the gradient taken in the forward "
        "(no full-vocabulary logits): true, false, or auto (on when the vocabulary has at least 32768 entries).",
    )

    @field_validator("next_tokens")
    @classmethod
    def _causal(cls, value: int) -> int:
        # Read here and nowhere else: 0 is the only value a causal LM trains with.
        if value != 0:
            raise ValueError(
                f"must be 0 for causal LM training, got {value}: with later tokens visible a token "
                "would see the tokens it is trained to predict (kernels.pre_tokens sets the window "
                "over earlier tokens)"
            )
        return value

    @model_validator(mode="after")
    def _exclusive(self) -> KernelsConfig:
        if self.use_triton_gdn and self.use_flash_gdn:
            raise rule_error(
                "use_flash_gdn", "use_flash_gdn and use_triton_gdn are mutually exclusive; enable at most one"
            )
        return self

    def enabled(self) -> list[str]:
        """Names of the switches turned on (true or auto)."""
        switches = (
            "use_flash_attn",
            "use_fused_rmsnorm",
            "use_fused_rotary_pos_emb",
            "moe_grouped_gemm",
            "use_triton_gdn",
            "use_flash_gdn",
            "use_triton_rmsnormgated",
            "use_ascend_mhc",
            "use_triton_swiglu_limit",
            "fix_router",
            "compile",
        )
        return [name for name in switches if getattr(self, name) not in (False, None)]


class LoraConfig(StrictSection):
    """Low-rank adapters."""

    target_modules: str | list[str] = describe("", "Module regex or list of patterns that get adapters.")
    exclude_layers: LayerSpecList | None = describe(None, "Layers without adapters, as layer specs.")
    lora_rank: PosInt = describe(8, "Adapter rank r.")
    lora_alpha: PosInt = describe(16, "Adapter scaling alpha (scale = alpha / r).")
    lora_dropout: NonNegFloat = describe(0.0, "Dropout on the adapter input.")
    lora_a_std: NonNegFloat = describe(0.01, "Init std of the A matrices.")
    lora_b_std: NonNegFloat = describe(0.0, "Init std of the B matrices.")
    adapter_path: str = describe(
        "",
        "A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str) and value.strip() and value != "all":
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"{value!r} is not a valid regular expression ({err})") from None
        if isinstance(value, list) and (not value or any(not v.strip() for v in value)):
            raise ValueError("a list of module names must be non-empty and have no blank entries")
        return value

    @field_validator("lora_dropout")
    @classmethod
    def _dropout(cls, value: float) -> float:
        if value >= 1:
            raise ValueError(f"must be in [0, 1), got {value}")
        return value
