"""Beam search: meshforge's own path (cache reordered to the beams) equals transformers' generate.

Each family's tiny HF folder is completed by `meshforge generate --num-beams N` in this process and
by transformers' ``generate(num_beams=N, do_sample=False)`` on the same folder, three prompts of
different lengths in one left-padded batch. A second test makes a token the greedy search often
picks the eos token, so hypotheses finish early and the length penalty and stop rules decide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshforge.models.registry import kv_cache_families
from tests.unit._generate_fixtures import FAMILY_CONFIGS, PROMPTS, generate, save_family, write_config

transformers = pytest.importorskip("transformers")

# Every family with a meshforge cache that transformers builds: beam search reorders each kind of
# layer cache (step3p5's and mamba3's beams are checked against their uncached ones in
# test_kv_cache_own.py).
FAMILIES = [name for name in kv_cache_families() if name in FAMILY_CONFIGS]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("beam_models")
    return {name: save_family(root / name, name) for name in FAMILIES}


def _encode(folder: Path) -> list[list[int]]:
    from meshforge.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(folder))
    return [tokenizer(t)["input_ids"] for t in PROMPTS]


def hf_beams(
    folder: Path, prompts: list[list[int]], max_new: int, eos: int | None = None, **kw
) -> list[list[int]]:
    """transformers' beam search on the folder (left-padded batch); tokens up to and including eos."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    eos = model.config.eos_token_id if eos is None else eos
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
            **kw,
        )
    rows = []
    for row in out[:, length:].tolist():
        kept = []
        for token in row:
            kept.append(token)
            if token == eos:
                break
        rows.append(kept)
    return rows


@pytest.mark.parametrize("cache", [True, False], ids=["kv_cache", "no_cache"])
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_tokens_equal_transformers(
    folders: dict[str, Path], tmp_path: Path, family: str, cache: bool
) -> None:
    folder = folders[family]
    reference = hf_beams(folder, _encode(folder), 8, num_beams=3)
    greedy = hf_beams(folder, _encode(folder), 8)
    assert reference != greedy  # the beams change the answer: the test can tell them apart
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {"infer_backend": "meshforge", "max_new_tokens": 8},
    )
    rc, _, rows = generate(
        config, tmp_path / "out.jsonl", prompts=PROMPTS, num_beams=3, no_kv_cache=not cache
    )
    assert rc == 0
    assert [r["token_ids"] for r in rows] == reference


def test_huggingface_backend_passes_the_beams_through(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["qwen3"]
    settings = {"length_penalty": 0.5, "early_stopping": True}
    reference = hf_beams(folder, _encode(folder), 8, num_beams=2, **settings)
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {"infer_backend": "huggingface", "max_new_tokens": 8, "num_beams": 2, **settings},
    )
    rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts=PROMPTS)
    assert rc == 0
    assert [r["token_ids"] for r in rows] == reference


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"length_penalty": 0.0, "early_stopping": True},
        {"length_penalty": 2.0, "early_stopping": "never"},
        {"repetition_penalty": 1.3},
    ],
    ids=["defaults", "no_penalty_early", "long_never", "repetition"],
)
def test_hypotheses_that_end_early(folders: dict[str, Path], tmp_path: Path, settings: dict) -> None:
    folder = folders["qwen3"]
    encoded = _encode(folder)
    free = hf_beams(folder, encoded, 10, num_beams=4)
    eos = free[1][2]  # a token the search picks: some hypotheses now end after a few tokens
    reference = hf_beams(folder, encoded, 10, eos=eos, num_beams=4, **settings)
    if "repetition_penalty" not in settings:  # the penalty steers the search away from that token
        assert any(row and row[-1] == eos for row in reference)
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {
            "infer_backend": "meshforge",
            "max_new_tokens": 10,
            "eos_token_id": [eos],
            "num_beams": 4,
            **settings,
        },
    )
    rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts=PROMPTS)
    assert rc == 0
    assert [r["token_ids"] for r in rows] == reference


@pytest.mark.parametrize(
    ("extra", "key"),
    [({"do_sample": True}, "inference.do_sample"), ({"stop_strings": ["x"]}, "inference.stop_strings")],
)
def test_beams_with_sampling_or_stop_strings_are_refused(tmp_path: Path, extra: dict, key: str) -> None:
    from meshforge.config import ConfigError, load_config
    from meshforge.infer.run import GenerateArgs, resolve_options

    config = write_config(tmp_path / "gen.yaml", "  model_type: qwen3", {"num_beams": 2, **extra})
    with pytest.raises(ConfigError) as err:
        load_config(str(config), [])
    assert f"{key}: not supported yet" in str(err.value)
    # The same from the command line: --num-beams over a config that samples.
    config = write_config(tmp_path / "flag.yaml", "  model_type: qwen3", extra)
    with pytest.raises(ConfigError) as err:
        resolve_options(load_config(str(config), []), GenerateArgs(str(config), [], [], num_beams=2))
    assert f"{key}: not supported yet" in str(err.value)
