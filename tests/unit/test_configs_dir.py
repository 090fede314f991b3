"""Every YAML shipped under configs/ and every reference example validates (`config validate`, exit 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshforge.config import load_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").rglob("*.yaml"))
REFERENCE = sorted((Path(__file__).parent / "fixtures" / "reference_yaml").glob("*.yaml"))
MINDSPEED = sorted((Path(__file__).parent / "fixtures" / "mindspeed").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_shipped_config_validates(path):
    cfg = load_config(path)
    report = validate_config(cfg)
    assert report.errors == []


@pytest.mark.parametrize(
    "path", REFERENCE + MINDSPEED, ids=[p.parent.name + "/" + p.stem for p in REFERENCE + MINDSPEED]
)
def test_reference_example_validates(path):
    report = validate_config(load_config(path))
    assert report.errors == []


def test_reference_examples_present():
    assert len(REFERENCE) == 16
