"""Model option parsing derived from each family's *Args dataclass (types + one positivity rule)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from meshforge.models.common.options import field_coercer, field_kinds, require_positive
from meshforge.models.registry import built_families, resolve_family

FAMILIES = built_families()


def _family(name: str):
    """The family's ``args`` module and its args dataclass (the type its spec parses into)."""
    module = importlib.import_module(f"meshforge.models.{name}.args")
    return module, type(resolve_family(model_type=name).parse_options({"flavor": "tiny"}))


def test_kinds_follow_the_field_types():
    _, args = _family("qwen3_moe")
    kinds = field_kinds(args)
    assert {"vocab_size", "head_dim", "pad_token_id"} <= kinds.ints  # `int` and `int | None`
    assert {"rms_norm_eps", "rope_theta"} <= kinds.floats and "tie_word_embeddings" in kinds.bools
    assert kinds.int_lists == {"mlp_only_layers"}
    assert "eos_token_id" not in kinds.ints | kinds.int_lists  # int | list[int] passes through
    assert "hidden_act" not in kinds.ints | kinds.floats | kinds.bools


def test_coercer_reads_yaml_spellings_and_refuses_wrong_kinds():
    _, args = _family("qwen3_moe")
    coerce = field_coercer(args)
    assert coerce("rms_norm_eps", "1e-6") == 1e-6 and coerce("vocab_size", "10") == 10
    assert coerce("mlp_only_layers", ["1", 2]) == [1, 2] and coerce("head_dim", None) is None
    with pytest.raises(ValueError, match="vocab_size: must be a number, got True"):
        coerce("vocab_size", True)
    with pytest.raises(ValueError, match="tie_word_embeddings: must be true or false"):
        coerce("tie_word_embeddings", 1)
    with pytest.raises(ValueError, match=r"mlp_only_layers\[1\]: must be an integer"):
        coerce("mlp_only_layers", [1, 2.5])
    with pytest.raises(ValueError, match="mlp_only_layers: must be a list of integers"):
        coerce("mlp_only_layers", 3)


@dataclasses.dataclass(frozen=True)
class _Sizes:
    width: int = 4
    depth: int = 2


def test_one_positivity_rule():
    require_positive(_Sizes(), ("width", "depth"))
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=f"depth: must be a positive integer, got {bad!r}"):
            require_positive(_Sizes(depth=bad), ("width", "depth"))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_parses_by_its_fields(name):
    module, args = _family(name)
    kinds = field_kinds(args)
    assert not hasattr(module, "_INT_FIELDS")  # no table beside the dataclass
    # The norm epsilon under the family's own name (rms_norm_eps, norm_eps, ...).
    (eps,) = [k for k in sorted(kinds.floats) if k.endswith("norm_eps")]
    # The flavor's own depth (other fields may depend on it), written as YAML text.
    depth = module.from_options({"flavor": "tiny"}).num_hidden_layers
    parsed = module.from_options({"flavor": "tiny", eps: "1e-5", "num_hidden_layers": str(depth)})
    assert getattr(parsed, eps) == 1e-5 and parsed.num_hidden_layers == depth
    assert {"vocab_size", "hidden_size", "num_hidden_layers"} <= kinds.ints
    with pytest.raises(ValueError, match="num_hidden_layers: must be a number, got True"):
        module.from_options({"flavor": "tiny", "num_hidden_layers": True})
    with pytest.raises(ValueError, match="hidden_size: must be a positive integer, got 0"):
        module.from_options({"flavor": "tiny", "hidden_size": 0})
