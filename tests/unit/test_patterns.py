"""Module-pattern semantics (`meshforge.utils.patterns`: `{*}`, ranges, globs) and error messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshforge.utils.patterns import compile_pattern, is_pattern, match_modules, suggest_names

CASES = [
    # pattern, name, expected
    ("model.layers.{*}", "model.layers.3", True),
    ("model.layers.{*}", "model.layers.12", True),
    ("model.layers.{*}", "model.layers.3.mlp", False),
    ("model.layers.{*}", "model.layers.x", False),
    ("model.layers.{*}", "model.layers.", False),
    ("model.layers.{}", "model.layers.7", True),
    ("model.layers.{}", "model.layers.7.mlp", False),
    ("model.layers.{1-3}", "model.layers.0", False),
    ("model.layers.{1-3}", "model.layers.1", True),
    ("model.layers.{1-3}", "model.layers.3", True),
    ("model.layers.{1-3}", "model.layers.4", False),
    ("model.layers.{1-3}", "model.layers.13", False),
    ("model.layers.{0-1}.mlp.{*}", "model.layers.1.mlp.5", True),
    ("model.layers.{0-1}.mlp.{*}", "model.layers.2.mlp.5", False),
    ("*.q_proj", "model.layers.0.self_attn.q_proj", True),
    ("*.q_proj", "q_proj", False),
    ("*q_proj", "q_proj", True),
    ("*gate", "model.layers.0.mlp.gate_proj", False),
    ("*gate", "model.layers.0.mlp.gate", True),
    ("*lm_head", "lm_head", True),
    ("model.*", "model.layers.0.mlp", True),  # `*` crosses dots
    ("model.layers.?", "model.layers.5", True),
    ("model.layers.?", "model.layers.15", False),
    ("model.embed_tokens", "model.embed_tokens", True),
    ("model.embed_tokens", "xmodel.embed_tokens", False),  # anchored at the start
    ("model.embed_tokens", "model.embed_tokens.weight", False),  # and at the end
    ("model.norm", "modelxnorm", False),  # `.` is literal, not a regex wildcard
    ("model.layers.{*}.mlp.experts", "model.layers.10.mlp.experts", True),
]


@pytest.mark.parametrize(("pattern", "name", "expected"), CASES)
def test_pattern_semantics(pattern: str, name: str, expected: bool) -> None:
    assert compile_pattern(pattern).matches(name) is expected


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("model.layers.{abc}", "unrecognised brace '{abc}'"),
        ("model.layers.{3-1}", "empty range"),
        ("model.layers.{1-}", "unrecognised brace"),
        ("model.layers.{*", "never closed"),
        ("model.layers.}", "no matching"),
        ("", "non-empty"),
    ],
)
def test_invalid_patterns_name_the_pattern(pattern: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        compile_pattern(pattern)
    assert fragment in str(err.value)
    assert repr(pattern) in str(err.value)


def test_is_pattern() -> None:
    assert is_pattern("*.bias") and is_pattern("layers.{*}") and is_pattern("a?b")
    assert not is_pattern("norm") and not is_pattern("model.layers.0.bias")


class _Node:
    """Duck-typed stand-in for nn.Module: only `named_modules()` is needed."""

    def __init__(self, names: list[str]) -> None:
        self._names = names

    def named_modules(self):
        return [(n, object()) for n in self._names]


TREE = _Node(
    [
        "",
        "model",
        "model.embed_tokens",
        "model.layers",
        "model.layers.0",
        "model.layers.0.self_attn",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp",
        "model.layers.0.mlp.gate_proj",
        "model.layers.1",
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp",
        "model.layers.1.mlp.gate_proj",
        "model.norm",
        "lm_head",
    ]
)


def test_match_modules_order_and_dedup() -> None:
    got = match_modules(TREE, ["lm_head", "model.layers.{*}", "model.layers.{0-0}"], key_path="parallel.x")
    # named_modules() order, each module once although two patterns match layer 0.
    assert [n for n, _ in got] == ["model.layers.0", "model.layers.1", "lm_head"]


def test_match_modules_no_match_names_key_and_examples() -> None:
    with pytest.raises(ValueError) as err:
        match_modules(TREE, ["*.q_proj", "model.layer.{*}"], key_path="parallel.fsdp_modules")
    msg = str(err.value)
    assert msg.startswith("parallel.fsdp_modules[1]: pattern 'model.layer.{*}' matches no module; e.g. ")
    assert "model.layers." in msg


def test_match_modules_invalid_pattern_names_key() -> None:
    with pytest.raises(ValueError, match=r"^parallel\.tp_colwise\[0\]: module pattern 'a\.\{x\}'"):
        match_modules(TREE, ["a.{x}"], key_path="parallel.tp_colwise")


def test_match_modules_on_real_module() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    assert [n for n, _ in match_modules(model, ["{*}"], key_path="k")] == ["0", "1", "2"]
    assert [n for n, _ in match_modules(model, ["{1-2}"], key_path="k")] == ["1", "2"]


@pytest.mark.procs
def test_patterns_module_is_light() -> None:
    code = "import sys, meshforge.utils.patterns; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_suggestions_rank_by_similarity_and_skip_repeated_layers() -> None:
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.{i}.{m}" for i in range(3) for m in ("self_attn.q_proj.bias", "mlp.gate_proj.weight")
    ]
    got = suggest_names("biass", names)
    assert got[0] == "model.layers.0.self_attn.q_proj.bias"
    assert len(got) == 3  # one name per shape: layers 1 and 2 repeat layer 0
    assert suggest_names("embeding", names)[0] == "model.embed_tokens.weight"
