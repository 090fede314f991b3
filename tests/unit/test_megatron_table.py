"""Every Megatron-style flag is read, refused or warned; the read ones are mapped; the docs table is generated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshforge.config import megatron_table as table
from meshforge.config.base import ConfigError
from meshforge.config.megatron_flags import FLAGS
from meshforge.config.megatron_import import import_megatron

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge" / "config"
DOC = Path(__file__).resolve().parents[2] / "docs" / "config-mapping.md"


def test_every_flag_is_read_refused_or_warned():
    kinds = {flag: table.classify(flag) for flag in FLAGS}
    assert [
        flag for flag, kind in kinds.items() if kind is None or kind.kind not in ("read", "refused", "warned")
    ] == []
    assert all(kind is not None and kind.detail for kind in kinds.values())
    # the list is Megatron-LM's whole parser plus the derived projects' flags
    origins = {origin for _takes, _group, origin in FLAGS.values()}
    assert origins == {"Megatron-LM", "MindSpeed-LLM", "MindSpeed"}
    assert sum(origin == "Megatron-LM" for *_, origin in FLAGS.values()) > 800
    for flag in (
        "--stage",
        "--is-instruction-dataset",
        "--prompt-type",
        "--lora-r",
        "--lora-target-modules",
        "--finetune",
    ):
        assert flag in FLAGS, flag


def test_the_tables_name_only_real_flags():
    for name in ("READ", "WARNED", "REFUSED"):
        assert [flag for flag in getattr(table, name) if flag not in FLAGS] == [], name
    assert table.classify("--num-layerz") is None


def test_every_read_flag_is_handled_by_the_mapper():
    """As config/readers.py's rule: the module that reads a flag names it."""
    source = "".join(
        (SRC / f).read_text(encoding="utf-8")
        for f in ("megatron_import.py", "megatron_model.py", "megatron_preference.py")
    )
    assert [flag for flag in table.READ if f'"{flag}"' not in source] == []


def test_issue_examples_are_warned_with_a_reason():
    for flag in (
        "--use-mcore-models",
        "--transformer-impl",
        "--distributed-backend",
        "--initial-loss-scale",
        "--no-masked-softmax-fusion",
        "--use-fused-rmsnorm",
    ):
        kind = table.classify(flag)
        assert kind is not None and kind.kind in ("warned", "read"), flag
    assert table.classify("--fp8-format") == table.FlagClass("refused", table.REFUSED["--fp8-format"])


def test_unknown_flag_has_a_suggestion_and_a_refused_flag_names_its_feature():
    with pytest.raises(ConfigError) as err:
        import_megatron(["--num-layerz", "2", "--lr", "1e-4", "--train-iters", "2"])
    assert "--num-layerz: unknown flag" in str(err.value) and "did you mean '--num-layers'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        import_megatron(["--sgd-momentum", "0.9"])
    assert (
        "error: --sgd-momentum: not supported yet: --sgd-momentum (Megatron-LM's 'regularization' flags)"
        in str(err.value)
    )


def test_config_mapping_doc_holds_the_generated_table():
    doc = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- megatron-table:start -->\n(.*?)<!-- megatron-table:end -->", doc, re.S)
    assert match, "docs/config-mapping.md: the generated Megatron table markers are missing"
    assert match.group(1) == table.markdown_table(), (
        "run: python -m meshforge.config.megatron_table (rewrites the section)"
    )
