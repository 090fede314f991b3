"""Which family and options a ``model:`` section builds: a built-in family or the generic path.

Split from ``hf.py`` (which reads and writes the weights) because choosing the model is a
separate question: config.json, ``model:`` overrides, the weights a folder really has
(``fit_to_weights``), and the fallback to transformers when no family is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshforge.checkpoint.hf import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    find_hf_weights,
    hf_adapter,
    read_hf_config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from meshforge.models.config import ModelConfig
    from meshforge.models.registry import FamilySpec


@dataclass(frozen=True)
class ModelSource:
    """Which family to build with which options, and the HF folder it came from (if any)."""

    family: FamilySpec
    options: dict[str, object]
    hf_dir: Path | None


def resolve_model_source(model_cfg: ModelConfig, *, log: Callable[[str], None] | None = None) -> ModelSource:
    """Family and options from the ``model:`` section, reading ``model_name_or_path/config.json``.

    With ``model_name_or_path``, config.json gives the options (mapped by the family's adapter)
    and, when the section names no family (``model_type`` / ``architectures`` / ``model_id``),
    the family too. Passthrough ``model:`` keys override config.json values; each override is
    logged.

    Args:
        model_cfg: The ``model:`` section (``ModelConfig``).
        log: Sink for the override lines.

    Raises:
        FileNotFoundError: When ``model_name_or_path`` is not a folder with config.json.
        ValueError: When the family is not built and transformers cannot build it either (the
            generic path), naming ``model.trust_remote_code`` when remote code needs it.
    """
    from meshforge.models.registry import resolve_family
    from meshforge.utils.resources import resolve_path

    emit = log or (lambda _msg: None)
    extra = dict(model_cfg.model_extra or {})
    named = (model_cfg.model_type, model_cfg.architectures, model_cfg.model_id)
    if not model_cfg.model_name_or_path:
        return ModelSource(resolve_family(*named), extra, None)
    hf_dir = resolve_path(model_cfg.model_name_or_path)
    if not hf_dir.is_dir():
        raise FileNotFoundError(
            f"model.model_name_or_path: {model_cfg.model_name_or_path!r} (resolved to {hf_dir}) is not a "
            "folder; give a local Hugging Face model folder (hub names are never downloaded)"
        )
    config = read_hf_config(hf_dir)
    if not any(named):
        named = (config.get("model_type"), config.get("architectures"), None)
    try:
        family = resolve_family(*named)
    except ValueError as err:
        return _generic_source(model_cfg, hf_dir, config, extra, str(err), emit)
    base = hf_adapter(family).from_hf_config(config)
    for key, value in extra.items():
        if key in base and base[key] != value:
            emit(f"model.{key}: {value!r} overrides {base[key]!r} from {hf_dir / CONFIG_FILE}")
        elif key not in base:
            emit(f"model.{key}: {value!r} (not set in {hf_dir / CONFIG_FILE})")
    options = {**base, **extra}
    _refit_layer_types(options, base, extra, emit)
    _fit_to_weights(family, options, extra, hf_dir, emit)
    try:
        family.parse_options(options)
    except ValueError as err:
        # Say where the value came from: config.json or a model: override.
        raise ValueError(
            f"model: {err} (options from {hf_dir / CONFIG_FILE} and the model: section)"
        ) from None
    return ModelSource(family, options, hf_dir)


def _fit_to_weights(
    family: FamilySpec,
    options: dict[str, object],
    extra: dict[str, object],
    hf_dir: Path,
    emit: Callable[[str], None],
) -> None:
    """The family adapter's ``fit_to_weights`` changes to config.json options (logged; ``model:`` keys kept).

    DeepSeek-V3: transformers' ``save_pretrained`` keeps ``num_nextn_predict_layers`` but writes no MTP weights.
    """
    fit = getattr(hf_adapter(family), "fit_to_weights", None)
    if fit is None or not any((hf_dir / name).is_file() for name in (INDEX_FILE, SINGLE_FILE)):
        return
    for key, (value, why) in fit(options, set(find_hf_weights(hf_dir))).items():
        if key not in extra:
            emit(f"model.{key}: {value!r} instead of {options.get(key)!r} from {hf_dir / CONFIG_FILE}: {why}")
            options[key] = value


def _generic_source(
    model_cfg: ModelConfig,
    hf_dir: Path,
    config: dict[str, object],
    extra: dict[str, object],
    unbuilt: str,
    emit: Callable[[str], None],
) -> ModelSource:
    """No built-in family: transformers' ``AutoModelForCausalLM`` from the folder (the generic path)."""
    from meshforge.models.generic.spec import generic_family

    family = generic_family(hf_dir, config, trust_remote_code=model_cfg.trust_remote_code)
    try:
        family.parse_options({})
    except ValueError as err:
        raise ValueError(f"{hf_dir / CONFIG_FILE}: {unbuilt}; {err}") from None
    for key, value in extra.items():
        if key in config and config[key] != value:
            emit(f"model.{key}: {value!r} overrides {config[key]!r} from {hf_dir / CONFIG_FILE}")
        elif key not in config:
            emit(f"model.{key}: {value!r} (not set in {hf_dir / CONFIG_FILE})")
    emit(f"model: {family.name} is not a built-in family; generic transformers path ({hf_dir})")
    return ModelSource(family, dict(extra), hf_dir)


def _refit_layer_types(
    options: dict[str, object], base: dict[str, object], extra: dict[str, object], emit: Callable[[str], None]
) -> None:
    """Keep config.json's per-layer ``layer_types`` valid when ``num_hidden_layers`` is overridden.

    transformers writes ``layer_types`` (one entry per layer) into config.json. When every entry is
    the same, a new layer count just repeats it; a mixed list cannot be guessed and is left for
    the family's validation to report.
    """
    types = base.get("layer_types")
    layers = extra.get("num_hidden_layers")
    if "layer_types" in extra or not isinstance(types, list) or not isinstance(layers, int):
        return
    if len(types) != layers and len(set(types)) == 1:
        options["layer_types"] = [types[0]] * layers
        emit(f"model.layer_types: {types[0]!r} repeated for the {layers} layers of model.num_hidden_layers")


def grown_options(
    model_cfg: ModelConfig,
    source: ModelSource,
    tokenizer: PreTrainedTokenizerBase | None,
    log: Callable[[str], None],
) -> dict[str, object]:
    """The model options with the vocabulary the run trained: tokens added by the config grow it."""
    if tokenizer is None:
        return dict(source.options)
    from meshforge.data.tokenizer import tokenizer_extension
    from meshforge.models.vocab import vocab_plan

    size = source.family.parse_options(source.options).vocab_size
    plan = vocab_plan(
        tokenizer, size, resize_vocab=model_cfg.resize_vocab, added=tokenizer_extension(tokenizer), log=log
    )
    return plan.model_options(dict(source.options))
