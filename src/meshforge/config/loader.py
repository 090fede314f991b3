"""Load a config: YAML file -> (MindSpeed import) -> overrides -> validated `TrainConfig`.

The YAML reader is PyYAML's safe loader with three fixes: `1e-8` is a float (YAML 1.2; PyYAML
reads it as a string), a duplicate key is an error instead of silently keeping the last one, and
positions are kept so that errors can name `file:line`. Loading never imports torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from meshforge.config import importer
from meshforge.config.base import ConfigError, Issue, format_validation_error, unknown_keys_message
from meshforge.config.mindspeed_args import BY_NAME as MINDSPEED_ARGUMENTS
from meshforge.config.root import SECTIONS, TrainConfig
from meshforge.config.rules import cross_section_issues
from meshforge.train.config import TrainingConfig

MAX_DEPTH = 32
_FLOAT_12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """Safe loader: YAML 1.2 exponent floats, duplicate keys rejected."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789"))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, object]:
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
            )
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _Dumper(yaml.SafeDumper):
    """Safe dumper that quotes strings `_Loader` would read as floats, so dumps load back equal."""


_Dumper.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789"))


def parse_yaml(text: str, source: str = "<string>") -> object:
    """Parse YAML text with meshforge's loader; malformed input raises ConfigError naming file:line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = exc.problem or str(exc)
        raise ConfigError([(where, f"malformed YAML: {problem}")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([(source, f"malformed YAML: {exc}")]) from None
    except RecursionError:
        raise ConfigError([(source, f"YAML nesting is too deep (limit {MAX_DEPTH} levels)")]) from None


def dump_yaml(data: object) -> str:
    """Dump plain data as block YAML that `parse_yaml` reads back to the same values."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _line_map(text: str) -> dict[str, int]:
    """Key path -> 1-based line of that key in the YAML text (best effort)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text, Loader=_Loader)  # noqa: S506
    except yaml.YAMLError:
        return lines

    def walk(node: yaml.Node, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                sub = f"{path}.{key_node.value}" if path else str(key_node.value)
                lines.setdefault(sub, key_node.start_mark.line + 1)
                walk(value_node, sub, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = f"{path}[{i}]"
                lines.setdefault(sub, item.start_mark.line + 1)
                walk(item, sub, depth + 1)

    if root is not None:
        walk(root, "", 0)
    return lines


def _depth(value: object, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, object], dict[str, int]]:
    """Read a YAML config file into a dict plus a key-path -> line map.

    Raises:
        ConfigError: missing file, unreadable or malformed YAML, a top level that is not a mapping.
    """
    source = str(path)
    file = Path(path)
    if not file.exists():
        raise ConfigError([(source, "config file not found")])
    if not file.is_file():
        raise ConfigError([(source, "is not a file")])
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(source, f"cannot read config file: {exc}")]) from None
    data = parse_yaml(text, source)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            [(source, f"the top level of a config must be a mapping of sections, got {type(data).__name__}")]
        )
    if _depth(data) > MAX_DEPTH:
        raise ConfigError([(source, f"YAML nesting is too deep (limit {MAX_DEPTH} levels)")])
    return data, _line_map(text)


# --- format detection ------------------------------------------------------------------------

FORMATS = ("native", "mindspeed", "llamafactory")

NATIVE_ONLY = frozenset(SECTIONS) - {"model", "training", "inference"}
_TRAINING_NATIVE = frozenset(TrainingConfig.model_fields) - set(importer.TRAINING_KEYS)
_TRAINING_MS = frozenset(importer.TRAINING_KEYS) - set(TrainingConfig.model_fields)


def _ms_key(key: str, value: object) -> bool:
    """Whether a top-level entry can only be MindSpeed (a group, or a flat MindSpeed key)."""
    if key in ("data", "parallel", "optimization"):
        return True
    # `recompute`/`optimizer` are both a native section (mapping) and a MindSpeed flat key (bool/str).
    if key == "recompute":
        return isinstance(value, bool)
    if key == "optimizer":
        return isinstance(value, str)
    return (key in importer.ALL_KEYS or key in MINDSPEED_ARGUMENTS) and key not in SECTIONS


def _llamafactory(data: Mapping[str, object]) -> bool:
    """Whether a top level is a LLaMA-Factory file: a key only LLaMA-Factory has (`learning_rate`,
    `finetuning_type`, `ddp_timeout`, ...); mixed with a key it does not have, an error."""
    from meshforge.config.llamafactory_import import llamafactory_only

    ours, others = llamafactory_only(dict(data), lambda k: k in importer.ALL_KEYS or k in MINDSPEED_ARGUMENTS)
    if ours and others:
        raise ConfigError(
            [
                (
                    others[0],
                    f"this file mixes the LLaMA-Factory format ({ours[0]!r}) with another ({others[0]!r} is no "
                    "LLaMA-Factory argument); write one format",
                )
            ]
        )
    return bool(ours)


def detect_format(data: Mapping[str, object]) -> str:
    """Return 'native', 'mindspeed' or 'llamafactory' for parsed YAML; a mixture raises ConfigError
    naming one key of each."""
    if _llamafactory(data):
        return "llamafactory"
    native_keys = [k for k, v in data.items() if k in NATIVE_ONLY and not _ms_key(k, v)]
    ms_keys = [k for k, v in data.items() if _ms_key(k, v)]
    training = data.get("training")
    if isinstance(training, dict):
        native_keys += [f"training.{k}" for k in training if k in _TRAINING_NATIVE]
        ms_keys += [f"training.{k}" for k in training if k in _TRAINING_MS]
    if native_keys and ms_keys:
        raise ConfigError(
            [
                (
                    ms_keys[0],
                    f"this file mixes the MindSpeed format ({ms_keys[0]!r}) with the native format ({native_keys[0]!r}); "
                    "write one format (`meshforge config import` converts MindSpeed files)",
                )
            ]
        )
    return "mindspeed" if ms_keys else "native"


# --- overrides -------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], str]:
    """Split `--a.b.c=value` (or `a.b.c=value`) into (['a','b','c'], 'value')."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError([(text, "an override must look like --section.key=value")])
    key, value = body.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError([(text, "an override must look like --section.key=value")])
    return parts, value


_BARE_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+)+=")


def _list_value(items: list[str]) -> str:
    """Several values after one `--a.b` (MindSpeed's list arguments) as one YAML flow list."""
    import json

    values: list[object] = []
    for item in items:
        try:
            value = yaml.load(item, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader
        except yaml.YAMLError:
            value = item
        values.append(value if isinstance(value, str | int | float | bool) or value is None else item)
    return json.dumps(values)


def split_cli_overrides(tokens: Sequence[str]) -> list[str]:
    """Command-line override tokens -> `a.b=value` strings.

    Accepts `--a.b=value`, `a.b=value`, and MindSpeed's argument-parser form `--a.b value` (several
    values give a list, as its list arguments take them; `--a.b` with no value is `true`, as its
    boolean arguments read it). Values are YAML, so JSON dicts and lists (`'{"file_name": ...}'`)
    and `True`/`False` read as MindSpeed reads them.

    Raises:
        ConfigError: a token that is neither an override nor a value of one.
    """
    out: list[str] = []
    i = 0
    items = list(tokens)
    while i < len(items):
        token = items[i]
        body = token[2:] if token.startswith("--") else token
        if "=" in body and (token.startswith("--") or _BARE_OVERRIDE.match(token)):
            key = body.split("=", 1)[0]
            if key.strip() and all(part for part in key.split(".")):
                out.append(body)
                i += 1
                continue
        if not token.startswith("--") or "." not in body or not all(body.split(".")):
            raise ConfigError(
                [
                    (
                        token,
                        "expected an override: --section.key=value or --section.key value (e.g. --training.steps 100)",
                    )
                ]
            )
        values: list[str] = []
        i += 1
        while i < len(items) and not items[i].startswith("--") and not _BARE_OVERRIDE.match(items[i]):
            values.append(items[i])
            i += 1
        if not values:
            out.append(f"{body}=true")
        elif len(values) == 1:
            out.append(f"{body}={values[0]}")
        else:
            out.append(f"{body}={_list_value(values)}")
    return out


def _field_wants_string(parts: list[str]) -> bool:
    """True when the schema types the overridden key as a string (so `--checkpoint.prefix=123` stays text)."""
    model: object = TrainConfig
    info = None
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        info = model.model_fields[part]
        model = info.annotation
    if info is None:
        return False
    return info.annotation in (str, str | None)


def apply_overrides(data: dict[str, object], overrides: Sequence[str]) -> dict[str, object]:
    """Return a copy of `data` with each `--section.key=value` applied (values parsed as YAML)."""
    out = {k: _copy(v) for k, v in data.items()}
    for text in overrides:
        parts, raw = parse_override(text)
        value = (
            raw
            if _field_wants_string(parts) and raw.strip() not in ("null", "~")
            else parse_yaml(raw, f"override {text}")
        )
        node = out
        for depth, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError([(where, f"override {text!r}: {where} is not a mapping (it is {nxt!r})")])
            node = nxt
        node[parts[-1]] = value
    return out


def _copy(value: object) -> object:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Overrides of MindSpeed keys (applied before import) vs native ones (applied after)."""
    ms: list[str] = []
    native: list[str] = []
    for text in overrides:
        parts, _ = parse_override(text)
        key = parts[-1]
        group_ok = len(parts) == 1 or (len(parts) == 2 and parts[0] == importer.ALL_KEYS.get(key))
        is_native = len(parts) == 2 and parts[0] in SECTIONS and key in _section_fields(parts[0])
        (ms if key in importer.ALL_KEYS and group_ok and not is_native else native).append(text)
    return ms, native


def _section_fields(section: str) -> set[str]:
    annotation = TrainConfig.model_fields[section].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return set(annotation.model_fields)
    return set()


# --- entry points ----------------------------------------------------------------------------


def config_from_dict(data: dict[str, object], *, source: str = "<dict>") -> TrainConfig:
    """Validate a native config dict into a frozen TrainConfig.

    Raises:
        ConfigError: with one (key path, reason) per problem.
    """
    if not isinstance(data, dict):
        raise ConfigError([(source, f"a config must be a mapping of sections, got {type(data).__name__}")])
    unknown = [str(k) for k in data if k not in SECTIONS]
    if unknown:
        path = unknown[0] if len(unknown) == 1 else "<top level>"
        raise ConfigError([(path, unknown_keys_message("the top level", unknown, SECTIONS))])
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    issues = cross_section_issues(cfg)
    if issues:
        raise ConfigError(issues)
    return cfg


def load_native_dict(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    *,
    fmt: str | None = None,
    log: Callable[[str], None] | None = None,
    origins: dict[str, tuple[str, object]] | None = None,
) -> tuple[dict[str, object], dict[str, str], str]:
    """Read, detect the format, import if MindSpeed or LLaMA-Factory, apply overrides: (native dict,
    where, format). Overrides of a LLaMA-Factory file are native paths, applied after the import.

    `where` maps a key path to where its value was written: `FILE:LINE`, or `command line` for a
    key an override set (which wins over the file's line for that key and the keys under it).

    `origins` (MindSpeed files) receives native path -> (MindSpeed key, value) for the error
    messages of `validate_imported`.
    """
    if fmt not in (None, *FORMATS, "megatron"):
        raise ConfigError([("--format", f"must be one of {', '.join([*FORMATS, 'megatron'])}, got {fmt!r}")])
    if fmt == "megatron" or (fmt is None and path is not None and _launch_script(path)):
        return _megatron_dict(str(path), overrides, log, origins)
    data, lines = read_config_file(path) if path is not None else ({}, {})
    source = str(path) if path is not None else "<defaults>"
    kind = fmt or detect_format(data)
    if kind == "mindspeed":
        ms_over, native_over = _split_overrides(overrides)
        data = apply_overrides(data, ms_over)
        if log:
            log(f"{source}: MindSpeed-LLM format; importing")
        data = importer.import_mindspeed(data, log, origins)
        lines = {}
        overrides = native_over
    elif kind == "llamafactory":
        data = _import_llamafactory(data, source, log, origins)
        lines = {}
    where = {key: f"{source}:{line}" for key, line in lines.items()}
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        where = {k: v for k, v in where.items() if k != key and not k.startswith(key + ".")}
        where[key] = "command line"
    return apply_overrides(data, overrides), where, kind


def _launch_script(path: str | os.PathLike) -> bool:
    from meshforge.config.launch_script import is_launch_script

    return Path(path).is_file() and is_launch_script(path)


def _megatron_dict(
    path: str,
    overrides: Sequence[str],
    log: Callable[[str], None] | None,
    origins: dict[str, tuple[str, object]] | None,
) -> tuple[dict[str, object], dict[str, str], str]:
    """A Megatron-style launch script (`config/megatron_import.py`); overrides are native paths."""
    from meshforge.config.megatron_import import import_launch_script

    if log:
        log(f"{path}: a Megatron-style launch script; importing its training line")
    data = import_launch_script(path, log, origins)
    where = {".".join(parse_override(text)[0]): "command line" for text in overrides}
    return apply_overrides(data, overrides), where, "megatron"


def _import_llamafactory(
    data: dict[str, object],
    source: str,
    log: Callable[[str], None] | None,
    origins: dict[str, tuple[str, object]] | None,
) -> dict[str, object]:
    """A LLaMA-Factory file imported (`config/llamafactory_import.py`); overrides stay native."""
    from meshforge.config.llamafactory_import import import_llamafactory

    if log:
        log(f"{source}: LLaMA-Factory format; importing")
    return import_llamafactory(data, log, origins)


def validate_imported(
    data: dict[str, object],
    origins: dict[str, tuple[str, object]],
    *,
    source: str = "<dict>",
    fmt: str = "mindspeed",
) -> TrainConfig:
    """`config_from_dict` for an imported file: errors name the MindSpeed or LLaMA-Factory key they
    came from, and a value MindSpeed accepts that is not built here is `not supported yet: <key>=<value>`."""
    from meshforge.config.llamafactory_import import explain_errors
    from meshforge.config.mindspeed_checks import explain_choices

    try:
        return config_from_dict(data, source=source)
    except ConfigError as err:
        if fmt == "llamafactory":
            raise explain_errors(err, origins) from None
        raise explain_choices(err, origins) from None


def _with_places(err: ConfigError, where: dict[str, str]) -> ConfigError:
    """Each issue with where its key (or the nearest key above it) was written."""
    if not where:
        return err
    issues: list[Issue] = []
    for path, reason in err.issues:
        probe = path
        while probe and probe not in where:
            probe = probe.rsplit(".", 1)[0] if "." in probe else ""
        issues.append((path, f"{reason} ({where[probe]})" if probe else reason))
    return ConfigError(issues)


def load_config(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    *,
    fmt: str | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainConfig:
    """Load and validate a config file (native, MindSpeed or LLaMA-Factory format) with
    `--section.key=value` overrides.

    Args:
        path: YAML file, or None for the defaults.
        overrides: e.g. `["--training.steps=100", "optimizer.betas=[0.9, 0.99]"]`.
        fmt: None to detect, or "native"/"mindspeed"/"llamafactory"/"megatron" to force.
        log: receives what each MindSpeed key became.

    Raises:
        ConfigError: every problem found, each with its key path.
    """
    origins: dict[str, tuple[str, object]] = {}
    data, where, kind = load_native_dict(path, overrides, fmt=fmt, log=log, origins=origins)
    try:
        return validate_imported(data, origins, source=str(path), fmt=kind)
    except ConfigError as err:
        raise _with_places(err, where) from None
