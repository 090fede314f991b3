"""Import a LLaMA-Factory training YAML (`llamafactory-cli train lf.yaml`) into the native format.

A LLaMA-Factory file is flat: every key is an argument of its dataclasses or of the HF Trainer
(`llamafactory_args`). Each key is mapped (logged `key: value -> native.path`), refused
(`not supported yet: <key>: <value> (<feature>)`, unless written at LLaMA-Factory's default), or
warned (`warning: <key>: <value> -> no effect: <reason>`), as `llamafactory_rules` says; a name
in no list is an unknown key with a suggestion. Where LLaMA-Factory's or the HF Trainer's default
differs from meshforge's and changes the run (AdamW's beta2 0.999, no weight decay, the linear
schedule, LoRA as the default method, gradient checkpointing on, ...), the default is written
into the result and logged "(LLaMA-Factory default)", so the imported file means what the
original meant. The HF Trainer's part (schedule, optimizer, saving, evaluation, trackers,
DeepSpeed/FSDP, the Megatron keys) is `llamafactory_training.py`.

Outputs land where LLaMA-Factory puts them: `checkpoint.export_dir` is `output_dir` (the PEFT
adapter of a LoRA run, the HF weights of a full run), `monitor.trainer_log` writes
`trainer_log.jsonl` beside `metrics.jsonl`, and `plot_loss` draws `training_loss.png`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from meshforge.config.base import ConfigError, Issue, suggest
from meshforge.config.importer import _set
from meshforge.config.llamafactory_args import BY_NAME
from meshforge.config.llamafactory_rules import MAPPED, REFUSED, WARNED
from meshforge.config.llamafactory_training import Importer, training_arguments

Say = Callable[[str], None]

# Values that differ from meshforge's defaults and change the run: applied when absent.
LF_DEFAULTS: dict[str, object] = {
    "stage": "sft",
    "finetuning_type": "lora",
    "output_dir": "trainer_output",  # the HF Trainer's own default (transformers 5)
    "dataset_dir": "data",
    "learning_rate": 5e-5,
    "lr_scheduler_type": "linear",
    "weight_decay": 0.0,
    "adam_beta2": 0.999,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "logging_steps": 500,
    "save_steps": 500,
    "save_total_limit": None,
    "dataloader_num_workers": 0,
    "dataloader_drop_last": False,
    "disable_shuffling": False,
}
# Data keys that go to `train_dataset.<key>` unchanged (the SFT loader's LLaMA-Factory fields).
SFT_KEYS = tuple(
    key for key, text in MAPPED.items() if text == f"`train_dataset.{key}`" and BY_NAME[key].group == "data"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # `org/name` or `name`, not `./dir`
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def import_llamafactory(
    raw: dict[str, object], log: Say | None = None, origins: dict[str, tuple[str, object]] | None = None
) -> dict[str, object]:
    """Map a LLaMA-Factory training YAML to a native config dict.

    Args:
        raw: the parsed YAML (flat keys).
        log: receives one line per key (what it became, or why it needs nothing).
        origins: filled with native path -> (LLaMA-Factory key, value), for error messages.

    Raises:
        ConfigError: unknown keys (with a suggestion), refused features (`not supported yet`),
            values LLaMA-Factory would reject or meshforge cannot express.
    """
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    issues: list[Issue] = []
    given: dict[str, object] = {}
    for key, value in raw.items():
        name = str(key)
        if name not in BY_NAME:
            guess = suggest(name, list(BY_NAME))
            hint = f"; did you mean {guess!r}?" if guess else ""
            issues.append((name, f"unknown LLaMA-Factory argument {name!r}{hint}"))
            continue
        given[name] = value
    native: dict[str, object] = {}
    where = origins if origins is not None else {}
    flat = {**LF_DEFAULTS, **given}
    flat.setdefault("lora_alpha", None)

    def to(path: str, value: object, key: str) -> None:
        _set(native, path, value)
        origin = "" if key in given else " (LLaMA-Factory default)"
        if key not in flat:
            where[path] = (key, value)
            say(f"{key} (not set) -> {path} = {value!r}{origin}")
            return
        shown = flat[key]
        where[path] = (key, shown)
        same = value == shown and type(value) is type(shown)
        say(f"{key}: {shown!r} -> {path}" + ("" if same else f" = {value!r}") + origin)

    imp = Importer(flat=flat, given=given, to=to, say=say, issues=issues)
    for key in given:
        if key in REFUSED:
            _refused(imp, key)
        elif key in WARNED:
            say(f"warning: {key}: {given[key]!r} -> no effect: {WARNED[key]}")
    _model(imp)
    _method(imp)
    _data(imp)
    training_arguments(imp)
    _unmentioned(imp, lines)
    if issues:
        raise ConfigError(issues)
    return native


def _unmentioned(imp: Importer, lines: list[str]) -> None:
    """Every key written is in the log or an issue: one the handlers left alone at its default
    (`resume_from_checkpoint: null`) says so; any other would be a key this
    importer ignores, which is refused rather than dropped."""
    named = {line.removeprefix("warning: ").split(":")[0].split(" ")[0] for line in lines}
    named |= {path for path, _ in imp.issues}
    for key, value in imp.given.items():
        if key in named:
            continue
        if value is None or value == BY_NAME[key].default:
            imp.say(f"{key}: {value!r} -> nothing to set (LLaMA-Factory's default)")
        else:
            imp.issues.append(
                (key, f"{value!r} was not read by the importer (a meshforge bug: please report it)")
            )


def _refused(imp: Importer, key: str) -> None:
    value, default = imp.given[key], BY_NAME[key].default
    if value == default or (value is None and default in ("", [], {})):
        imp.say(f"{key}: {value!r} -> LLaMA-Factory's default, nothing to do ({REFUSED[key]}: not built)")
        return
    imp.issues.append((key, f"not supported yet: {key}: {value!r} ({REFUSED[key]})"))


# --- model -------------------------------------------------------------------------------


def _offline() -> str | None:
    """The variable that turns downloads off, if one does."""
    for var in OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


def _model_folder(imp: Importer, value: object) -> str | None:
    """A local folder as it is; a hub id fetched through huggingface_hub unless downloads are off."""
    if not isinstance(value, str) or not value:
        imp.issues.append(("model_name_or_path", f"must be a model folder or hub id, got {value!r}"))
        return None
    if Path(value).expanduser().is_dir() or value.startswith("meshforge://") or not _HUB_ID.match(value):
        return value
    var = _offline()
    if var is not None:
        imp.issues.append(
            (
                "model_name_or_path",
                f"{value!r} is not a local folder and downloads are off ({var}={os.environ[var]}): "
                f"download it (`hf download {value} --local-dir DIR`) and give that folder",
            )
        )
        return None
    from huggingface_hub import snapshot_download  # the hub client transformers downloads with

    try:
        folder = snapshot_download(
            value, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        )
    except Exception as err:  # noqa: BLE001 - any hub failure is one line for the user
        imp.issues.append(
            ("model_name_or_path", f"{value!r} is not a local folder, and the hub did not give it: {err}")
        )
        return None
    imp.say(f"model_name_or_path: {value!r} is not a local folder: downloaded to {folder}")
    return str(folder)


def _model(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    folder = None
    if "model_name_or_path" in given:
        folder = _model_folder(imp, given["model_name_or_path"])
        if folder is not None:
            to("model.model_name_or_path", folder, "model_name_or_path")
    else:
        imp.issues.append(("model_name_or_path", "LLaMA-Factory needs it: the model folder to train"))
    for key in (
        "use_fast_tokenizer",
        "resize_vocab",
        "split_special_tokens",
        "add_tokens",
        "add_special_tokens",
        "new_special_tokens_config",
        "init_special_tokens",
        "train_from_scratch",
    ):
        if key in given:
            to(f"model.{key}", given[key], key)
    if "moe_aux_loss_coef" in given and given["moe_aux_loss_coef"] is not None:
        to("training.router_aux_loss_coef", given["moe_aux_loss_coef"], "moe_aux_loss_coef")
    _remote_code(imp, folder)
    if "flash_attn" in given:
        table = {"auto": "auto", "fa2": True, "fa3": True, "sdpa": False, "eager": False, "disabled": False}
        value = given["flash_attn"]
        if value in table:
            to("kernels.use_flash_attn", table[str(value)], "flash_attn")
        else:
            imp.issues.append(("flash_attn", f"must be one of {sorted(table)}, got {value!r}"))
    if flat.get("pure_bf16") is True:
        to("model.compute_dtype", "bfloat16", "pure_bf16")
        to("model.params_dtype", "bfloat16", "pure_bf16")
        for key in ("bf16", "fp16"):
            if given.get(key) is True:
                imp.say(f"{key}: True -> unused: pure_bf16 trains in bfloat16 throughout")
    elif flat.get("bf16") is True and flat.get("fp16") is True:
        imp.issues.append(("bf16", "bf16 and fp16 are both true; set one"))
    elif flat.get("bf16") is True:
        to("model.compute_dtype", "bfloat16", "bf16")
    elif flat.get("fp16") is True:
        to("model.compute_dtype", "float16", "fp16")
    if flat.get("fp8") is True:
        backend = flat.get("fp8_backend", "auto")
        if backend not in ("auto", "torchao"):
            imp.issues.append(
                ("fp8_backend", f"not supported yet: fp8_backend: {backend!r} (meshforge's FP8 is torchao's)")
            )
        else:
            to("model.quant_recipe_name", "tensorwise", "fp8")
            if "fp8_backend" in given:
                imp.say(f"fp8_backend: {backend!r} -> torchao float8 (what meshforge uses)")
        if "fp8_enable_fsdp_float8_all_gather" in given:
            value = given["fp8_enable_fsdp_float8_all_gather"]
            to("model.enable_fsdp_low_precision_all_gather", value, "fp8_enable_fsdp_float8_all_gather")
    else:
        for key in ("fp8_backend", "fp8_enable_fsdp_float8_all_gather"):
            if key in given:
                imp.say(f"{key}: {given[key]!r} -> unused: fp8 is off")


def _auto_map(folder: Path) -> str | None:
    """The file of `folder` that asks for the folder's own code (`auto_map`), if any."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            body = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(body, dict) and body.get("auto_map"):
            return name
    return None


def _remote_code(imp: Importer, folder: str | None) -> None:
    """`trust_remote_code`: meshforge's import never runs a model folder's code (docs/security.md)."""
    value = imp.given.get("trust_remote_code")
    if value is None or value is False:
        return
    needing = (
        _auto_map(Path(folder).expanduser()) if folder and not folder.startswith("meshforge://") else None
    )
    if value is True and needing is not None:
        imp.issues.append(
            (
                "trust_remote_code",
                f"not supported yet: trust_remote_code: true ({folder}/{needing} names its own code in auto_map; "
                "an imported LLaMA-Factory file never runs a model folder's code: read that code and set "
                "model.trust_remote_code: true in a native file to run it, see docs/security.md)",
            )
        )
        return
    imp.say(
        f"warning: trust_remote_code: {value!r} -> no effect: the model folder needs no code of its own, and "
        "meshforge runs none from it (docs/security.md)"
    )


# --- method: stage and finetuning type -----------------------------------------------------


def _method(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    stage = flat["stage"]
    if stage in ("kto", "ppo"):
        imp.issues.append(
            (
                "stage",
                f"not supported yet: stage: {stage} (preference and reward training from LLaMA-Factory files)",
            )
        )
    elif stage not in ("pt", "sft", "dpo", "rm"):
        imp.issues.append(("stage", f"must be one of pt, sft, rm, ppo, dpo, kto; got {stage!r}"))
    else:
        to("training.stage", stage, "stage")
    # The DPO loss keys keep their names (training.*); with another stage meshforge refuses them.
    for key in ("pref_beta", "pref_ftx", "pref_loss", "dpo_label_smoothing", "simpo_gamma"):
        if key in given:
            to(f"training.{key}", given[key], key)
    if flat.get("do_train", True) is not True:
        imp.refuse("do_train", "runs without training: evaluation or prediction only")
    elif "do_train" in given:
        imp.say("do_train: True -> meshforge train trains")
    kind = flat["finetuning_type"]
    if kind == "freeze":
        imp.issues.append(
            (
                "finetuning_type",
                "not supported yet: finetuning_type: freeze (freeze (partial-parameter) fine-tuning: "
                "freeze_trainable_layers, freeze_trainable_modules, freeze_extra_modules)",
            )
        )
    elif kind == "oft":
        imp.issues.append(("finetuning_type", "not supported yet: finetuning_type: oft (OFT adapters)"))
    elif kind == "lora":
        _lora(imp)
    elif kind == "full":
        imp.say(
            f"finetuning_type: {kind!r} -> every parameter trains"
            + ("" if "finetuning_type" in given else " (LLaMA-Factory default)")
        )
        for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "adapter_name_or_path"):
            if key in given:
                imp.say(f"{key}: {given[key]!r} -> unused: finetuning_type is full")
    else:
        imp.issues.append(("finetuning_type", f"must be one of lora, oft, freeze, full; got {kind!r}"))
    _outputs(imp, kind)
    if flat.get("use_muon") is True:
        to("optimizer.type", "Muon", "use_muon")
    if "disable_shuffling" in flat:
        to("train_dataset.dataloader.shuffle", flat["disable_shuffling"] is not True, "disable_shuffling")


def _lora(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    rank = flat.get("lora_rank", 8)
    to("lora_config.lora_rank", rank, "lora_rank")
    alpha = flat.get("lora_alpha")
    # LLaMA-Factory: `lora_alpha or lora_rank * 2`.
    to(
        "lora_config.lora_alpha",
        alpha if alpha else rank * 2 if isinstance(rank, int) else rank,
        "lora_alpha",
    )
    if "lora_dropout" in given:
        to("lora_config.lora_dropout", given["lora_dropout"], "lora_dropout")
    target = flat.get("lora_target", "all")
    if isinstance(target, str) and target.strip() != "all":
        target = [name.strip() for name in target.split(",") if name.strip()]
    elif isinstance(target, str):
        target = "all"
    to("lora_config.target_modules", target, "lora_target")
    adapter = given.get("adapter_name_or_path")
    if isinstance(adapter, str) and "," in adapter:
        imp.issues.append(
            (
                "adapter_name_or_path",
                f"not supported yet: adapter_name_or_path: {adapter!r} (several adapters merged in turn)",
            )
        )
    elif adapter is not None:
        to("lora_config.adapter_path", adapter, "adapter_name_or_path")


def _outputs(imp: Importer, kind: object) -> None:
    """LLaMA-Factory's outputs: the adapter or weights in output_dir, trainer_log.jsonl, the plot."""
    flat, to = imp.flat, imp.to
    out = flat["output_dir"]
    to("training.output_dir", out, "output_dir")
    to("checkpoint.export_dir", out, "output_dir")
    if kind == "full":
        to("checkpoint.save_hf_weights", True, "finetuning_type")
    to("monitor.trainer_log", True, "output_dir")
    if "plot_loss" in imp.given:
        to("monitor.plot_loss", imp.given["plot_loss"], "plot_loss")


# --- data ----------------------------------------------------------------------------------


def _data(imp: Importer) -> None:
    flat, given, to = imp.flat, imp.given, imp.to
    if flat["stage"] == "pt":
        _pretraining_data(imp)
        return
    to("train_dataset.dataloader.type", "SFTDataLoader", "stage")
    to("train_dataset.dataset_dir", flat["dataset_dir"], "dataset_dir")
    for key in SFT_KEYS:
        if key in given and key != "dataset_dir":
            to(f"train_dataset.{key}", given[key], key)
    if "cutoff_len" in given:
        to("train_dataset.cutoff_len", given["cutoff_len"], "cutoff_len")
    if "packing" in given and given["packing"] is not None:
        to("train_dataset.packing", given["packing"], "packing")


def _dataset_files(imp: Importer, names: object, folder: str) -> tuple[list[str], str | None]:
    """The local files and text column of LLaMA-Factory dataset names (dataset_info.json)."""
    info_path = Path(folder).expanduser() / "dataset_info.json"
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        imp.issues.append(("dataset_dir", f"{info_path}: cannot read dataset_info.json ({err})"))
        return [], None
    files, columns = [], set()
    for name in [n.strip() for n in str(names).split(",") if n.strip()]:
        entry = info.get(name) if isinstance(info, dict) else None
        if not isinstance(entry, dict):
            imp.issues.append(("dataset", f"{name!r} is not in {info_path}"))
            continue
        if "file_name" not in entry or any(
            k in entry for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url")
        ):
            imp.issues.append(
                (
                    "dataset",
                    f"not supported yet: dataset: {name} (pretraining data from a hub or script; give a local file_name)",
                )
            )
            continue
        files.append(str(Path(folder) / str(entry["file_name"])))
        cols = entry.get("columns")
        columns.add(cols.get("prompt", "text") if isinstance(cols, dict) else "instruction")
    if len(columns) > 1:
        imp.issues.append(
            (
                "dataset",
                f"the pretraining datasets name different text columns {sorted(columns)}; meshforge reads one",
            )
        )
    return files, next(iter(columns), None)


def _pretraining_data(imp: Importer) -> None:
    """stage pt: the dataset_info files as raw text, packed into cutoff_len rows (meshforge's text loader).

    LLaMA-Factory appends EOS to each document, concatenates them and cuts disjoint blocks of
    cutoff_len tokens; the text loader appends the end-of-document token too and cuts
    Megatron-style rows (consecutive rows share one token, so every token is a target once).
    """
    flat, given, to = imp.flat, imp.given, imp.to
    to("train_dataset.dataloader.type", "TextDataLoader", "stage")
    if given.get("packing") is False:
        imp.issues.append(
            ("packing", "not supported yet: packing: false with stage pt (one padded row per document)")
        )
    if "dataset" not in given:
        imp.issues.append(("dataset", "stage pt needs the dataset names (dataset_info.json entries)"))
        return
    files, column = _dataset_files(imp, given["dataset"], str(flat["dataset_dir"]))
    if "dataset_dir" in given:
        imp.say(f"dataset_dir: {given['dataset_dir']!r} -> where the dataset names are looked up")
    if files:
        to("train_dataset.dataloader.data_path", files, "dataset")
        to("train_dataset.dataloader.text_key", column, "dataset")
    to("train_dataset.dataloader.seq_length", flat.get("cutoff_len", 2048), "cutoff_len")
    imp.say(
        "stage: 'pt' -> rows cut Megatron-style from the token stream (LLaMA-Factory cuts disjoint blocks)"
    )
    if given.get("max_samples") is not None:
        to("train_dataset.dataloader.max_documents", given["max_samples"], "max_samples")
    for key in SFT_KEYS:
        if key in given and key not in (
            "dataset",
            "dataset_dir",
            "max_samples",
            "preprocessing_num_workers",
            "overwrite_cache",
        ):
            imp.issues.append(
                (
                    key,
                    f"not supported yet: {key}: {given[key]!r} with stage pt (the text loader does not read it)",
                )
            )
    for key in ("preprocessing_num_workers", "overwrite_cache"):
        if key in given:
            imp.say(f"{key}: {given[key]!r} -> unused: the text loader tokenizes in memory")


def explain_errors(err: ConfigError, origins: dict[str, tuple[str, object]]) -> ConfigError:
    """Validation errors of an imported file, each naming the LLaMA-Factory key it came from; a
    chat template meshforge does not build is `not supported yet: template: <name>`."""
    issues: list[Issue] = []
    for path, reason in err.issues:
        origin = origins.get(path)
        if origin is None:
            issues.append((path, reason))
        elif path == "train_dataset.template" and reason.startswith("unknown template"):
            built = reason.split("(built: ", 1)[-1].rstrip(")")
            issues.append(
                (origin[0], f"not supported yet: template: {origin[1]} (a chat template; built: {built})")
            )
        else:
            issues.append((path, f"{reason} (from LLaMA-Factory {origin[0]}: {origin[1]!r})"))
    return ConfigError(issues)


def llamafactory_only(
    data: dict[str, object], mindspeed: Callable[[str], bool]
) -> tuple[list[str], list[str]]:
    """(top-level keys only LLaMA-Factory has, keys it does not have) of a parsed YAML file.

    `mindspeed(key)` says whether a key is a MindSpeed argument or group: a key both formats
    have (`model_name_or_path`, `dataset`, ...) decides nothing.
    """
    ours = [str(k) for k in data if str(k) in BY_NAME and not mindspeed(str(k))]
    others = [str(k) for k in data if str(k) not in BY_NAME]
    return ours, others
