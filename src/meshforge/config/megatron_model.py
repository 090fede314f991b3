"""The `model:` section from Megatron flags: family, sizes, MoE, MLA, MTP, vocabulary (torch-free).

The family comes from `--spec` / `--model-type-hf`, else from `--load`'s config.json, else from
the flags themselves (`--multi-latent-attention`: deepseek_v3; `--num-experts` with
`--qk-layernorm`: qwen3_moe; `--qk-layernorm`: qwen3; neither: llama). When `--load` is a Hugging
Face folder the model is that folder's and every model flag given must agree with its config.json
(an error names the flag and both values). Megatron's module names in flags (`linear_qkv`,
`linear_fc1`, ...) are mapped to the family's own (`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`).
"""

from __future__ import annotations

import json
from pathlib import Path

from meshforge.config.megatron_values import Flags, Native

# --model-type-hf (MindSpeed-LLM's names) and --spec words -> meshforge family.
HF_TYPES = {
    "qwen3": "qwen3",
    "qwen3-moe": "qwen3_moe",
    "qwen3_moe": "qwen3_moe",
    "llama2": "llama",
    "llama3": "llama",
    "llama": "llama",
    "deepseek3": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
QK_NORM = {"qwen3": True, "qwen3_moe": True, "llama": False, "deepseek_v3": False}
MOE = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}

# Megatron module names -> the family's (HF) module names.
DENSE_NAMES = {
    "linear_qkv": ["q_proj", "k_proj", "v_proj"],
    "linear_proj": ["o_proj"],
    "linear_fc1": ["gate_proj", "up_proj"],
    "linear_fc2": ["down_proj"],
}
MLA_NAMES = {
    "linear_q_proj": ["q_proj"],
    "linear_q_down_proj": ["q_a_proj"],
    "linear_q_up_proj": ["q_b_proj"],
    "linear_kv_down_proj": ["kv_a_proj_with_mqa"],
    "linear_kv_up_proj": ["kv_b_proj"],
    "linear_proj": ["o_proj"],
    "linear_fc1": ["gate_proj", "up_proj"],
    "linear_fc2": ["down_proj"],
}


def module_names(family: str, names: list[str], flag: str, flags: Flags) -> list[str]:
    """Megatron module names -> the family's; a name neither knows is an issue."""
    table = MLA_NAMES if family == "deepseek_v3" else DENSE_NAMES
    out: list[str] = []
    for name in names:
        if name in table:
            out += [n for n in table[name] if n not in out]
        elif any(name in targets for targets in table.values()):
            out.append(name)  # already the family's own name
        else:
            flags.refuse(flag, f"unknown module {name!r} for {family}; Megatron's names: {sorted(table)}")
    return out


def read_config_json(folder: str) -> dict[str, object] | None:
    file = Path(folder) / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def family_of(flags: Flags, hf: dict[str, object] | None) -> str | None:
    """The family the flags name or imply; None (an issue recorded) when none is built."""
    spec = " ".join(flags.words("--spec"))
    hf_type = flags.text("--model-type-hf")
    if hf_type is not None:
        if hf_type not in HF_TYPES:
            flags.refuse(
                "--model-type-hf", f"not supported yet: {hf_type!r} (built families: {sorted(set(HF_TYPES))})"
            )
            return None
        return HF_TYPES[hf_type]
    moe = "--num-experts" in flags
    for word, family in (("qwen3", "qwen3"), ("deepseek", "deepseek_v3"), ("llama", "llama")):
        if word in spec:
            return "qwen3_moe" if family == "qwen3" and moe else family
    if hf is not None and isinstance(hf.get("model_type"), str):
        return str(hf["model_type"])
    if flags.on("--multi-latent-attention"):
        return "deepseek_v3"
    qk = flags.on("--qk-layernorm")
    if moe and not qk:
        flags.refuse(
            "--num-experts",
            "not supported yet: a MoE model without --qk-layernorm (Mixtral-style experts; the built MoE "
            "families are qwen3_moe and deepseek_v3)",
        )
        return None
    return ("qwen3_moe" if moe else "qwen3") if qk else "llama"


def _check_family_flags(family: str, flags: Flags) -> None:
    if family not in QK_NORM:
        return
    if flags.on("--qk-layernorm") != QK_NORM[family] and family != "deepseek_v3":
        need = "needs --qk-layernorm" if QK_NORM[family] else "has no q/k norm: drop --qk-layernorm"
        flags.refuse("--qk-layernorm", f"{family} {need}")
    if "--multi-latent-attention" in flags and family != "deepseek_v3":
        flags.refuse("--multi-latent-attention", f"{family} has no multi-latent attention")
    norm = flags.text("--normalization", "LayerNorm")
    if norm != "RMSNorm":
        flags.refuse(
            "--normalization", f"not supported yet: --normalization {norm} (the built families use RMSNorm)"
        )
    if not flags.on("--swiglu"):
        flags.refuse("--swiglu", "not supported yet: an MLP without --swiglu (GeLU MLPs are not built)")
    kind = flags.text("--position-embedding-type", "learned_absolute")
    rotary = flags.on("--use-rotary-position-embeddings")
    rope = kind == "rope" or rotary
    if not rope:
        flags.refuse("--position-embedding-type", f"not supported yet: {kind} (rope only)")
    percent = flags.float("--rotary-percent", 1.0)
    if percent != 1.0:
        flags.refuse("--rotary-percent", f"not supported yet: rope on part of the head ({percent})")
    hidden = flags.float("--hidden-dropout")
    if hidden not in (None, 0.0):
        flags.refuse("--hidden-dropout", f"not supported yet: residual dropout {hidden} (give 0.0)")


def _vocab(flags: Flags, native: Native, paths: Native) -> None:
    padded = flags.int("--padded-vocab-size")
    if padded is not None:
        native.to("model.vocab_size", padded, "--padded-vocab-size")
        flags.read.add("--make-vocab-size-divisible-by")
        return
    size = flags.int("--vocab-size")
    flag = "--vocab-size"
    if size is None:
        tokenizer = paths.get("model.tokenizer_name_or_path") or paths.get("model.model_name_or_path")
        size = tokenizer_size(str(tokenizer)) if tokenizer else None
        flag = "--tokenizer-name-or-path"
    if size is None:
        flags.refuse(
            "--padded-vocab-size",
            "give --padded-vocab-size (or --vocab-size): the tokenizer's size could not be read from its folder",
        )
        return
    multiple = (flags.int("--make-vocab-size-divisible-by", 128) or 128) * (
        flags.int("--tensor-model-parallel-size", 1) or 1
    )
    padded = -(-size // multiple) * multiple
    native.to(
        "model.vocab_size", padded, flag, f"{size} padded to a multiple of {multiple}, as Megatron pads"
    )


def tokenizer_size(folder: str) -> int | None:
    """len(tokenizer) of a Hugging Face tokenizer folder, from tokenizer.json (no transformers)."""
    file = Path(folder) / "tokenizer.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
        ids |= {int(token["id"]) for token in data.get("added_tokens", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(ids)


def _sizes(family: str, flags: Flags, native: Native) -> None:
    plain = {
        "--num-layers": "num_hidden_layers",
        "--hidden-size": "hidden_size",
        "--ffn-hidden-size": "intermediate_size",
        "--num-attention-heads": "num_attention_heads",
        "--kv-channels": "head_dim",
        "--max-position-embeddings": "max_position_embeddings",
    }
    for flag, key in plain.items():
        value = flags.int(flag)
        if value is not None and not (family == "deepseek_v3" and key == "head_dim"):
            native.to(f"model.{key}", value, flag)
    heads = flags.int("--num-attention-heads")
    if flags.on("--group-query-attention"):
        groups = flags.int("--num-query-groups", 1)
        native.to("model.num_key_value_heads", groups, "--num-query-groups")
    elif heads is not None:
        native.to(
            "model.num_key_value_heads", heads, "--group-query-attention", "no GQA: one kv head per head"
        )
        if "--num-query-groups" in flags:
            flags.read.add("--num-query-groups")
            flags.refuse(
                "--num-query-groups",
                "has no effect without --group-query-attention (Megatron ignores it too)",
            )
    floats = {
        "--norm-epsilon": "rms_norm_eps",
        "--init-method-std": "initializer_range",
        "--attention-dropout": "attention_dropout",
    }
    defaults = {"--norm-epsilon": 1e-5, "--init-method-std": 0.02, "--attention-dropout": 0.1}
    for flag, key in floats.items():
        native.to(f"model.{key}", flags.float(flag, defaults[flag]), flag)
    base = flags.float("--rotary-base", 10000.0)
    native.to("model.rope_theta", base, "--rotary-base")
    native.to(
        "model.tie_word_embeddings",
        not flags.on("--untie-embeddings-and-output-weights"),
        "--untie-embeddings-and-output-weights",
    )
    bias = not flags.on("--disable-bias-linear")
    if bias and family != "llama":
        flags.refuse(
            "--disable-bias-linear",
            f"not supported yet: linear biases in {family} (Megatron's default; give --disable-bias-linear)",
        )
    if family == "llama":
        native.to("model.attention_bias", bias or flags.on("--add-qkv-bias"), "--disable-bias-linear")
        native.to("model.mlp_bias", bias, "--disable-bias-linear")
    elif flags.on("--add-qkv-bias"):
        flags.refuse("--add-qkv-bias", f"not supported yet: q/k/v biases only, in {family}")


def _moe(family: str, flags: Flags, native: Native) -> None:
    experts = flags.int("--num-experts")
    if family not in MOE:
        if experts is not None:
            flags.refuse("--num-experts", f"{family} is a dense family")
        return
    if experts is not None:
        native.to(f"model.{MOE[family]}", experts, "--num-experts")
    for flag, key in (
        ("--moe-router-topk", "num_experts_per_tok"),
        ("--moe-ffn-hidden-size", "moe_intermediate_size"),
    ):
        value = flags.int(flag)
        if value is not None:
            native.to(f"model.{key}", value, flag)
    layers = flags.int("--num-layers") or 0
    dense_first = flags.int("--first-k-dense-replace")
    freq = flags.text("--moe-layer-freq")
    if freq is not None and freq not in ("1", "-1"):
        pattern = _layer_pattern(freq, layers, flags)
        if pattern is not None:
            dense_first = next((i for i, moe in enumerate(pattern) if moe), layers)
            if any(not moe for moe in pattern[dense_first:]):
                flags.refuse(
                    "--moe-layer-freq", f"not supported yet: dense layers after the first MoE layer ({freq})"
                )
    if dense_first is not None and dense_first > 0:
        if family == "deepseek_v3":
            native.to("model.first_k_dense_replace", dense_first, "--first-k-dense-replace")
        else:
            native.to("model.mlp_only_layers", list(range(dense_first)), "--first-k-dense-replace")
    elif family == "deepseek_v3":
        native.to("model.first_k_dense_replace", 0, "--first-k-dense-replace")
    shared = flags.int("--n-shared-experts")
    size = flags.int("--moe-shared-expert-intermediate-size")
    if size is not None and shared is None:
        per = flags.int("--moe-ffn-hidden-size") or size
        shared = size // per
    if shared:
        if family != "deepseek_v3":
            flags.refuse(
                "--moe-shared-expert-intermediate-size", f"not supported yet: shared experts in {family}"
            )
        else:
            native.to("model.n_shared_experts", shared, "--n-shared-experts")
    score = flags.text("--moe-router-score-function", "softmax")
    want = "sigmoid" if family == "deepseek_v3" else "softmax"
    if score != want:
        flags.refuse("--moe-router-score-function", f"{family} routes with {want}, got {score}")
    if family == "qwen3_moe":
        # Megatron's router: top-k of the logits then a softmax over those k (= renormalised
        # probabilities), unless --moe-router-pre-softmax (softmax over all experts, not renormalised)
        pre = flags.on("--moe-router-pre-softmax")
        norm = flags.on("--norm-topk-prob") or not pre
        flag = "--norm-topk-prob" if "--norm-topk-prob" in flags else "--moe-router-pre-softmax"
        native.to("model.norm_topk_prob", norm, flag)
        if flags.on("--moe-router-enable-expert-bias"):
            flags.refuse("--moe-router-enable-expert-bias", "not supported yet: an expert bias in qwen3_moe")
    else:
        for flag, key, kind in (
            ("--moe-router-topk-scaling-factor", "routed_scaling_factor", float),
            ("--moe-router-num-groups", "n_group", int),
            ("--moe-router-group-topk", "topk_group", int),
        ):
            number = flags.number(flag, kind)
            if number is not None:
                native.to(f"model.{key}", kind(number), flag)
        flags.on("--moe-router-enable-expert-bias")
        flags.on("--moe-router-pre-softmax")
    balance = flags.text("--moe-router-load-balancing-type", "aux_loss")
    coef = flags.float("--moe-aux-loss-coeff", 0.0) or 0.0
    if balance == "none":
        coef = 0.0
    elif balance not in ("aux_loss", "seq_aux_loss"):
        flags.refuse("--moe-router-load-balancing-type", f"not supported yet: {balance}")
    native.to("training.router_aux_loss_coef", coef, "--moe-aux-loss-coeff")


def _layer_pattern(freq: str, layers: int, flags: Flags) -> list[bool] | None:
    """Megatron's --moe-layer-freq: N (every Nth layer) or a list expression like `[0]*3+[1]*58`."""
    import re

    if freq.isdigit():
        step = int(freq)
        return [i % step == 0 for i in range(layers)]
    if not re.fullmatch(r"[\[\]0-9*+, ]+", freq):
        flags.refuse("--moe-layer-freq", f"expects N or a list like [0]*3+[1]*58, got {freq!r}")
        return None
    pattern: list[bool] = []
    for part in freq.replace(" ", "").split("+"):
        match = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", part)
        if not match:
            flags.refuse("--moe-layer-freq", f"cannot read {part!r} of {freq!r}")
            return None
        pattern += [v == "1" for v in match.group(1).split(",")] * int(match.group(2) or 1)
    if layers and len(pattern) != layers:
        flags.refuse("--moe-layer-freq", f"has {len(pattern)} entries for {layers} layers")
        return None
    return pattern


def _mla(family: str, flags: Flags, native: Native) -> None:
    keys = {
        "--q-lora-rank": "q_lora_rank",
        "--kv-lora-rank": "kv_lora_rank",
        "--qk-head-dim": "qk_nope_head_dim",
        "--qk-pos-emb-head-dim": "qk_rope_head_dim",
        "--v-head-dim": "v_head_dim",
    }
    for flag, key in keys.items():
        value = flags.int(flag)
        if value is None:
            continue
        if family != "deepseek_v3":
            flags.refuse(flag, f"multi-latent attention flags need an MLA family, got {family}")
            continue
        native.to(f"model.{key}", value, flag)
    mtp = flags.int("--mtp-num-layers")
    if mtp:
        if family != "deepseek_v3":
            flags.refuse("--mtp-num-layers", f"not supported yet: multi-token prediction in {family}")
        else:
            native.to("model.num_nextn_predict_layers", mtp, "--mtp-num-layers")
            scale = flags.float("--mtp-loss-scaling-factor", 0.1)
            native.to("training.mtp_loss_scaling_factor", scale, "--mtp-loss-scaling-factor")


def _agree(flags: Flags, built: dict[str, object], hf: dict[str, object], folder: str) -> None:
    """Every model value the flags set must equal config.json's."""
    aliases = {"rope_theta": ("rope_theta", "rope_parameters.rope_theta")}
    for key, value in built.items():
        if key in ("model_type", "architectures"):
            continue
        for name in aliases.get(key, (key,)):
            theirs: object = hf
            for part in name.split("."):
                theirs = theirs.get(part) if isinstance(theirs, dict) else None
            if theirs is None:
                continue
            same = (
                float(theirs) == float(value)
                if isinstance(theirs, int | float) and isinstance(value, int | float)
                else theirs == value
            )
            if not same:
                flag = _flag_of(key, flags)
                flags.issues.append(
                    (flag, f"{flag} gives {key} {value!r} but {folder}/config.json has {theirs!r}")
                )
            break


def _flag_of(key: str, _flags: Flags | None = None) -> str:
    table = {
        "num_hidden_layers": "--num-layers",
        "hidden_size": "--hidden-size",
        "intermediate_size": "--ffn-hidden-size",
        "num_attention_heads": "--num-attention-heads",
        "num_key_value_heads": "--num-query-groups",
        "head_dim": "--kv-channels",
        "max_position_embeddings": "--max-position-embeddings",
        "rms_norm_eps": "--norm-epsilon",
        "rope_theta": "--rotary-base",
        "tie_word_embeddings": "--untie-embeddings-and-output-weights",
        "vocab_size": "--padded-vocab-size",
        "num_experts": "--num-experts",
        "num_local_experts": "--num-experts",
        "n_routed_experts": "--num-experts",
        "num_experts_per_tok": "--moe-router-topk",
        "moe_intermediate_size": "--moe-ffn-hidden-size",
    }
    return table.get(key, f"(model.{key})")


def _generic(flags: Flags, native: Native, hf: dict[str, object], load: str) -> None:
    """A `--load` folder of a family meshforge has no module of (Mixtral, ...): transformers'
    model through the generic path; the size flags given must still agree with its config.json."""
    native.to(
        "model.model_name_or_path",
        load,
        "--load",
        f"model_type {hf.get('model_type')!r}: transformers' model (the generic path); the other model flags are config.json's",
    )
    given: dict[str, object] = {}
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_experts_per_tok",
    ):
        flag = _flag_of(key)
        value = flags.int(flag)
        if value is not None:
            given[key] = value
    experts = flags.int("--num-experts")
    if experts is not None:
        key = next(
            (k for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in hf), "num_experts"
        )
        given[key] = experts
    groups = flags.int("--num-query-groups")
    if flags.on("--group-query-attention") and groups is not None:
        given["num_key_value_heads"] = groups
    _agree(flags, given, hf, load)
    coef = flags.float("--moe-aux-loss-coeff")
    if coef is not None:
        native.to("training.router_aux_loss_coef", coef, "--moe-aux-loss-coeff")


def model_section(flags: Flags, native: Native) -> str | None:
    """Write `model:` from the flags; returns the family (None when no family is built for them)."""
    load = flags.text("--load")
    hf = read_config_json(load) if load else None
    family = family_of(flags, hf)
    if family is None:
        return None
    theirs = hf.get("model_type") if hf is not None else None
    named = "--model-type-hf" if "--model-type-hf" in flags else "--spec" if "--spec" in flags else None
    if theirs is not None and named is not None and theirs != family:
        flags.refuse(
            named, f"{named} gives the family {family!r} but {load}/config.json has model_type {theirs!r}"
        )
        return None
    if family not in ARCHITECTURES:
        if hf is None or load is None:
            flags.refuse("--model-type-hf", f"not supported yet: model_type {family!r} from Megatron flags")
            return None
        _generic(flags, native, hf, load)
        return family
    _check_family_flags(family, flags)
    if "--hidden-dropout" not in flags:
        native.say(
            "--hidden-dropout not given: Megatron's default 0.1 (residual dropout) is not built; "
            "trained without it (give --hidden-dropout 0.0 to say so)"
        )
    scratch = Native(flags, lambda _line: None, {})
    target = scratch if hf is not None else native
    _sizes(family, flags, target)
    _moe(family, flags, target)
    _mla(family, flags, target)
    if hf is None or "--padded-vocab-size" in flags or "--vocab-size" in flags:
        _vocab(flags, target, native)
    if hf is not None:
        assert load is not None
        native.to(
            "model.model_name_or_path", load, "--load", "a Hugging Face folder: its config.json and weights"
        )
        model = scratch.data.get("model")
        built = model if isinstance(model, dict) else {}
        given = {k: v for k, v in built.items() if _flag_of(k, flags) in flags.given}
        _agree(flags, given, hf, load)
        for key in ("router_aux_loss_coef", "mtp_loss_scaling_factor"):
            value = scratch.get(f"training.{key}")
            if value is not None:
                native.to(
                    f"training.{key}",
                    value,
                    "--moe-aux-loss-coeff" if key.startswith("router") else "--mtp-loss-scaling-factor",
                )
    else:
        native.to(
            "model.model_type",
            family,
            "--spec"
            if "--spec" in flags
            else "--model-type-hf"
            if "--model-type-hf" in flags
            else "--qk-layernorm",
            "the family",
        )
        native.to(
            "model.architectures", ARCHITECTURES[family], "--spec" if "--spec" in flags else "--qk-layernorm"
        )
    return family
