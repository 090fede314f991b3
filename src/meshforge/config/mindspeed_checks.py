"""What the MindSpeed importer checks against MindSpeed-LLM's own argument list (`mindspeed_args`).

- Booleans are read as MindSpeed's parser reads them (`1`/`0`, `yes`/`no`, ...), and each such
  reading is logged; the native format keeps strict `true`/`false`. `auto`, meshforge's value of
  the kernel switches that take it, is passed on to the `kernels` section.
- An argument MindSpeed defines that meshforge does not map is accepted at MindSpeed's default (it
  changes nothing, and is logged) and answers `not supported yet: <name>` with any other value.
- A `model_id` without a built family answers `not supported yet: model family <id>` naming the
  built ones.
- After validation, an error on a native field whose value came from a MindSpeed choice that
  MindSpeed accepts (`fsdp_implementation: custom`) becomes `not supported yet: <name>=<value>`.
"""

from __future__ import annotations

from collections.abc import Callable

from meshforge.config.base import ConfigError, Issue
from meshforge.config.mindspeed_args import BY_NAME, as_bool

Say = Callable[[str], None]
# native path -> (MindSpeed argument, the value given for it)
Origins = dict[str, tuple[str, object]]


def coerce_booleans(flat: dict[str, object], say: Say, issues: list[Issue]) -> None:
    """Replace each boolean argument's value by the bool MindSpeed reads from it, in place."""
    for key, value in list(flat.items()):
        arg = BY_NAME.get(key)
        if arg is None or arg.kind != "bool" or isinstance(value, bool) or value is None:
            continue
        if arg.group == "optimization" and value == "auto":
            continue  # meshforge's own value of some kernel switches (on where available)
        read = as_bool(value)
        if read is None:
            issues.append(
                (key, f"must be a boolean (true/false; MindSpeed also reads 1/0, yes/no), got {value!r}")
            )
            continue
        flat[key] = read
        say(f"{key}: {value!r} read as {read} (MindSpeed reads 1/0, yes/no, t/f as booleans)")


def unbuilt_argument(path: str, key: str, value: object, say: Say) -> Issue | None:
    """A MindSpeed argument meshforge does not map: None (logged) at its default, else an issue."""
    arg = BY_NAME[key]
    read = as_bool(value) if arg.kind == "bool" else value
    if read == arg.default:
        say(f"{key} = {value!r}: MindSpeed's default, no effect (not built in meshforge)")
        return None
    return (
        path,
        f"not supported yet: {key}={value!r} (a MindSpeed-LLM argument that meshforge does not build; "
        f"remove it or set it to its default {arg.default!r})",
    )


def model_family_issue(model_id: object, has_folder: bool) -> Issue | None:
    """`not supported yet: model family <id>` for a model_id no built family answers to."""
    if not isinstance(model_id, str):
        return None
    from meshforge.models.registry import built_families, resolve_family

    try:
        resolve_family(model_id=model_id)
    except ValueError:
        pass
    else:
        return None
    generic = (
        "; without model_id, model_name_or_path trains through the generic transformers path"
        if has_folder
        else "; or give model_name_or_path (a local Hugging Face folder) without model_id to train it "
        "through the generic transformers path"
    )
    known = BY_NAME["model_id"].choices
    where = "a MindSpeed-LLM model_id" if model_id in known else "not a MindSpeed-LLM model_id either"
    return (
        "model_id",
        f"not supported yet: model family {model_id} ({where}); built: {', '.join(built_families())}{generic}",
    )


def explain_choices(err: ConfigError, origins: Origins) -> ConfigError:
    """Rewrite validation errors on values MindSpeed accepts but meshforge does not build."""
    issues: list[Issue] = []
    for path, reason in err.issues:
        origin = origins.get(path)
        if origin is not None:
            key, value = origin
            arg = BY_NAME.get(key)
            if arg is not None and arg.kind == "choice" and value in arg.choices:
                issues.append(
                    (key, f"not supported yet: {key}={value} (MindSpeed-LLM accepts it; here: {reason})")
                )
                continue
            issues.append((path, f"{reason} (from MindSpeed {key}={value!r})"))
            continue
        issues.append((path, reason))
    return ConfigError(issues)
