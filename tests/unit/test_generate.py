"""`meshforge generate`: greedy tokens equal transformers' generate, seeded sampling, chat, bad inputs.

Each family's tiny HF folder (random weights, the bundled tokenizer) is completed by `meshforge
generate` in this process, with both backends, with and without the KV cache, three prompts of
different lengths in one left-padded batch; the reference is transformers' `generate` on the same
folder (greedy, same eos / pad ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshforge.models.registry import SPECS, kv_cache_families
from tests.unit._generate_fixtures import (
    FAMILY_CONFIGS,
    GENERIC,
    PROMPTS,
    generate,
    hf_greedy,
    own_only_args,
    save_family,
    write_config,
)

transformers = pytest.importorskip("transformers")

# Every family meshforge's cache runs (its spec's `kv_cache`) that transformers builds too, and a
# generic-path model; the others are compared with their own whole-sequence forward
# (test_kv_cache_own.py).
FAMILIES = [*(name for name in kv_cache_families() if name in FAMILY_CONFIGS), GENERIC]
_CACHES = {spec.name: spec.kv_cache() for spec in SPECS if spec.kv_cache is not None}
# The families with a transformers folder whose decoder asks for one mask per forward (the
# mask-free fast path applies); the families without one are checked in test_kv_cache_own.py.
ONE_MASK = [
    name for name, modules in sorted(_CACHES.items()) if not modules.masks_by_layer_kind and name in FAMILIES
]


def test_every_cached_family_has_a_tiny_folder() -> None:
    """A family given a KV cache gets token equality with transformers here: it needs its folder
    (or, where transformers has no such model, tiny args of its own)."""
    from meshforge.infer.generate import _transformers_builds

    own_only = own_only_args()
    assert not set(own_only) & set(FAMILY_CONFIGS)
    assert set(FAMILY_CONFIGS) - {GENERIC} | set(own_only) == set(kv_cache_families())
    assert not any(_transformers_builds(name) for name in own_only)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen_models")
    return {name: save_family(root / name, name) for name in FAMILIES}


def _encode(folder: Path, texts: list[str]) -> list[list[int]]:
    from meshforge.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(folder))
    return [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("cache", [True, False], ids=["kv_cache", "no_cache"])
@pytest.mark.parametrize("backend", ["meshforge", "huggingface"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(
    folders: dict[str, Path], tmp_path: Path, family: str, backend: str, cache: bool
) -> None:
    folder = folders[family]
    reference = hf_greedy(folder, _encode(folder, PROMPTS), 10, use_cache=cache)
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {"infer_backend": backend, "max_new_tokens": 10},
    )
    rc, printed, rows = generate(config, tmp_path / "out.jsonl", prompts=PROMPTS, no_kv_cache=not cache)
    assert rc == 0
    assert [r["token_ids"] for r in rows] == reference
    assert [r["prompt"] for r in rows] == PROMPTS
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert [r["completion"] for r in rows] == [
        tokenizer.decode(t, skip_special_tokens=True) for t in reference
    ]
    assert rows[0]["completion"] in printed


def _variants(family: str) -> list[torch.nn.Module]:
    """Models of every config variant the family's own tests build (layer kinds mixed)."""
    if family == "gpt_oss":
        from meshforge.models.gpt_oss.model import GptOssForCausalLM as cls
        from tests.unit.test_gpt_oss import CONFIGS
    else:
        from meshforge.models.qwen3_next.model import Qwen3NextForCausalLM as cls  # type: ignore[assignment]
        from tests.unit.test_qwen3_next import CONFIGS  # type: ignore[no-redef]
    with torch.device("meta"):
        return [cls(args) for args in CONFIGS.values()]


def _own_args_variants(family: str) -> list[torch.nn.Module]:
    """step3p5 and mamba3: their tests' configs, their flavors and the generation tests' args."""
    if family == "step3p5":
        from meshforge.models.step3p5.args import FLAVORS
        from meshforge.models.step3p5.model import Step3p5ForCausalLM as cls
        from tests.unit.test_step3p5 import ARGS

        configs = [ARGS, *FLAVORS.values()]
    else:
        from meshforge.models.mamba3.args import FLAVORS  # type: ignore[no-redef]
        from meshforge.models.mamba3.model import Mamba3ForCausalLM as cls  # type: ignore[assignment]
        from tests.unit.test_mamba3 import CASES

        configs = [*CASES.values(), *FLAVORS.values()]
    with torch.device("meta"):
        return [cls(args) for args in [*configs, own_only_args()[family]]]  # type: ignore[arg-type]


# The families whose cache modules are their own (not the DecoderModel ones): their layer-kind
# variants, keyed by family (a new such family fails below until it has its entry).
OWN_CACHE_VARIANTS = {
    "gpt_oss": _variants,
    "qwen3_next": _variants,
    "step3p5": _own_args_variants,
    "mamba3": _own_args_variants,
}


@pytest.mark.parametrize("family", sorted(OWN_CACHE_VARIANTS))
def test_families_with_their_own_cache_modules_have_a_cache(family: str) -> None:
    from meshforge.infer.kv_cache import cache_support
    from meshforge.models.common.family_parts import decoder_kv_cache

    own = {spec.name for spec in SPECS if spec.kv_cache not in (None, decoder_kv_cache)}
    assert set(OWN_CACHE_VARIANTS) == own
    for model in OWN_CACHE_VARIANTS[family](family):
        assert cache_support(model) is None


def test_generic_path_model_has_no_own_cache(folders: dict[str, Path]) -> None:
    from meshforge.infer.kv_cache import cache_support

    model = transformers.AutoModelForCausalLM.from_pretrained(folders[GENERIC])
    reason = cache_support(model)
    assert reason is not None and "MistralForCausalLM" in reason


def test_eos_ends_one_row_and_the_others_continue(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["qwen3"]
    encoded = _encode(folder, PROMPTS)
    free = hf_greedy(folder, encoded, 10)
    eos = free[1][3]  # the fourth greedy token of the second prompt becomes the eos token
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {"infer_backend": "meshforge", "max_new_tokens": 10, "eos_token_id": [eos]},
    )
    rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts=PROMPTS)
    assert rc == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    got = [r["token_ids"] for r in rows]
    assert got[1] == free[1][:4]
    for row, full in zip(got, free, strict=True):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)


def test_seeded_sampling_is_repeatable_and_the_seed_matters(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["llama"]
    sample = {"infer_backend": "meshforge", "max_new_tokens": 12, "do_sample": True, "temperature": 1.5}
    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folder}", sample)
    runs = [
        generate(config, tmp_path / f"out{i}.jsonl", prompts=PROMPTS, seed=seed)[2]
        for i, seed in enumerate([3, 3, 4])
    ]
    tokens = [[r["token_ids"] for r in rows] for rows in runs]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]
    greedy = hf_greedy(folder, _encode(folder, PROMPTS), 12)
    assert tokens[0] != greedy  # sampling really samples


def test_filters_match_transformers_processors() -> None:
    from transformers import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from meshforge.infer.sampling import SamplingOptions, apply_repetition_penalty, filter_logits

    torch.manual_seed(0)
    scores = torch.randn(3, 50) * 3
    seq = torch.randint(0, 50, (3, 7))
    options = SamplingOptions(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    ours = filter_logits(apply_repetition_penalty(scores, seq, 1.3), options)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(seq, scores.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        ref = warper(seq, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    kept = ~torch.isinf(ref)
    assert torch.equal(ours[kept], ref[kept])


def test_conversations_use_the_chat_template(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["qwen3"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "the model reads a file"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": messages}) + "\n" + json.dumps({"prompt": "and returns"}) + "\n"
    )
    config = write_config(
        tmp_path / "gen.yaml", f"  model_name_or_path: {folder}", {"infer_backend": "meshforge"}
    )
    rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts_file=str(prompts), max_new_tokens=6)
    assert rc == 0
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = hf_greedy(folder, [tokenizer(chat, add_special_tokens=False)["input_ids"]], 6)
    assert rows[0]["token_ids"] == expected[0] and rows[0]["prompt"] == messages
    # --chat renders plain text as one user turn: the same tokens as the conversation.
    rc, _, chat_rows = generate(
        config, tmp_path / "c.jsonl", prompts=["the model reads a file"], chat=True, max_new_tokens=6
    )
    assert chat_rows[0]["token_ids"] == expected[0]


def test_interactive_keeps_history_and_resets(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["qwen3"]
    config = write_config(
        tmp_path / "gen.yaml",
        f"  model_name_or_path: {folder}",
        {"infer_backend": "meshforge", "max_new_tokens": 5},
    )
    rc, printed, _ = generate(
        config, tmp_path / "x.jsonl", interactive=True, stdin="hello\nhi\n/reset\nhi\n/exit\n"
    )
    assert rc == 0
    replies = [
        line.removeprefix("> ")
        for line in printed.splitlines()[1:]
        if line.removeprefix("> ") and "history cleared" not in line
    ]
    assert len(replies) == 3, printed
    _, _, fresh = generate(config, tmp_path / "f.jsonl", prompts=["hi"], chat=True)
    assert replies[2] == fresh[0]["completion"]  # after /reset: no history
    convo = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "hi"},
    ]
    file = tmp_path / "h.jsonl"
    file.write_text(json.dumps({"messages": convo}) + "\n")
    _, _, second = generate(config, tmp_path / "s.jsonl", prompts_file=str(file))
    assert replies[1] == second[0]["completion"]  # the second turn saw the first


def test_dcp_step_generates_the_hf_folders_tokens(folders: dict[str, Path], tmp_path: Path) -> None:
    import yaml

    from meshforge.cli.convert import hf_to_dcp

    folder = folders["llama"]
    step = hf_to_dcp(folder, tmp_path / "step", log=lambda _m: None)
    model = yaml.safe_load((step / "model.yaml").read_text())["model"]
    lines = (
        "".join(f"  {k}: {json.dumps(v)}\n" for k, v in model.items()) + f"  tokenizer_name_or_path: {folder}"
    )
    config = write_config(tmp_path / "gen.yaml", lines)
    (tmp_path / "gen.yaml").write_text(
        (tmp_path / "gen.yaml").read_text() + f"checkpoint:\n  load_path: {step}\n"
    )
    reference = hf_greedy(folder, _encode(folder, PROMPTS), 8)
    for backend in ("meshforge", "huggingface"):
        rc, _, rows = generate(
            config, tmp_path / "out.jsonl", prompts=PROMPTS, backend=backend, max_new_tokens=8
        )
        assert rc == 0
        assert [r["token_ids"] for r in rows] == reference, backend


def test_stop_strings_end_and_cut_the_completion(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["qwen3"]
    config = write_config(
        tmp_path / "gen.yaml", f"  model_name_or_path: {folder}", {"infer_backend": "meshforge"}
    )
    _, _, free = generate(config, tmp_path / "a.jsonl", prompts=PROMPTS[:1], max_new_tokens=10)
    text = free[0]["completion"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, _, cut = generate(config, tmp_path / "b.jsonl", prompts=PROMPTS[:1], max_new_tokens=10, stop=[stop])
    assert cut[0]["completion"] == text[: text.find(stop)]
    assert len(cut[0]["token_ids"]) < len(free[0]["token_ids"])


def test_bad_inputs_name_the_key_flag_or_file(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = folders["qwen3"]
    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folder}")
    out = tmp_path / "o.jsonl"

    assert generate(config, out, prompts=["word " * 80])[0] == 2
    err = capsys.readouterr().err
    assert "--prompt #1" in err and "max_position_embeddings" in err and "64" in err

    assert generate(config, out, prompts_file=str(tmp_path / "missing.jsonl"))[0] == 2
    err = capsys.readouterr().err
    assert "--prompts" in err and "missing.jsonl" in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    assert generate(config, out, prompts_file=str(bad))[0] == 2
    assert f"{bad}:2" in capsys.readouterr().err

    assert generate(config, out, prompts=["x"], top_p=1.5)[0] == 2
    assert "--top-p (inference.top_p)" in capsys.readouterr().err

    bad_cfg = write_config(tmp_path / "bad.yaml", f"  model_name_or_path: {folder}", {"temperature": 0})
    assert generate(bad_cfg, out, prompts=["x"])[0] == 2
    assert "inference.temperature" in capsys.readouterr().err

    lora = tmp_path / "lora.yaml"
    lora.write_text(config.read_text() + "lora_config:\n  lora_rank: 8\n")
    assert generate(lora, out, prompts=["x"])[0] == 2
    assert "lora_config.target_modules: empty" in capsys.readouterr().err  # nothing to adapt

    window = tmp_path / "window.yaml"
    window.write_text(config.read_text() + "kernels:\n  pre_tokens: 16\n")
    assert generate(window, out, prompts=["x"])[0] == 2
    assert "kernels.pre_tokens: not supported yet by meshforge generate" in capsys.readouterr().err

    assert generate(config, out)[0] == 2
    assert "no prompt" in capsys.readouterr().err


def test_mindspeed_inference_arguments_import_into_the_section(tmp_path: Path) -> None:
    from meshforge.config import load_config

    path = tmp_path / "ms.yaml"
    path.write_text(
        "model:\n  model_name_or_path: /x\ninference:\n  infer_backend: huggingface\n"
        "  max_new_tokens: 17\n  do_sample: true\n"
    )
    cfg = load_config(str(path), [], fmt="mindspeed")
    assert cfg.inference.max_new_tokens == 17 and cfg.inference.do_sample is True
    assert cfg.inference.infer_backend == "huggingface"


def test_eval_num_beams_sets_the_beams_of_generate_and_warns_in_training() -> None:
    from meshforge.config import config_from_dict
    from meshforge.config.noops import noop_notes
    from meshforge.infer.run import GenerateArgs, resolve_options

    cfg = config_from_dict(
        {
            "model": {"model_type": "qwen3"},
            "train_dataset": {"dataloader": {"type": "SFTDataLoader"}, "eval_num_beams": 4},
        }
    )
    notes = dict(noop_notes(cfg, "cpu"))
    assert "meshforge generate" in notes["train_dataset.eval_num_beams"]
    args = GenerateArgs(config="x.yaml", overrides=[], prompts=[])
    assert resolve_options(cfg, args).num_beams == 4
    # inference.num_beams (or --num-beams) wins over it.
    assert (
        resolve_options(cfg, GenerateArgs(config="x.yaml", overrides=[], prompts=[], num_beams=2)).num_beams
        == 2
    )


@pytest.mark.parametrize("family", ONE_MASK)
def test_unpadded_batches_take_the_mask_free_path_with_the_same_tokens(
    folders: dict[str, Path], tmp_path: Path, family: str
) -> None:
    from meshforge.infer.kv_cache import KVCache

    folder = folders[family]
    same_length = [PROMPTS[0], PROMPTS[0].replace("file", "line")]
    encoded = _encode(folder, same_length)
    assert len(encoded[0]) == len(encoded[1])
    assert KVCache(torch.ones(2, 3, dtype=torch.bool), 8).mask(torch.zeros(2, 1, dtype=torch.long)) is None
    config = write_config(
        tmp_path / "gen.yaml", f"  model_name_or_path: {folder}", {"infer_backend": "meshforge"}
    )
    for prompts in (same_length[:1], same_length):
        rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts=prompts, max_new_tokens=10)
        assert rc == 0
        assert [r["token_ids"] for r in rows] == hf_greedy(folder, _encode(folder, prompts), 10)


@pytest.mark.procs
def test_interactive_command_reads_stdin(folders: dict[str, Path], tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folders['qwen3']}")
    cmd = [sys.executable, "-m", "meshforge", "generate", "-c", str(config), "--interactive"]
    cmd += ["--backend", "meshforge", "--max-new-tokens", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd, input="hello\n/reset\n/exit\n", env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "/reset clears the history" in proc.stdout and "(history cleared)" in proc.stdout


def test_missing_chat_template_is_named_before_the_model_loads(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    folder = shutil.copytree(folders["qwen3"], tmp_path / "no_template")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "model.safetensors").unlink()  # would fail the load: the prompt error must come first
    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folder}")
    assert generate(config, tmp_path / "o.jsonl", prompts=["hi"], chat=True)[0] == 2
    err = capsys.readouterr().err
    assert "--prompt #1" in err and "chat template" in err


def test_generate_leaves_a_callers_process_group_and_ends_its_own(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """Run from code with a group already set up (a notebook, a test's ranks), the command uses
    that group and leaves it; run alone, it sets up its own and tears it down."""
    import torch.distributed as dist

    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {folders['qwen3']}")
    assert not dist.is_initialized()
    assert generate(config, tmp_path / "a.jsonl", prompts=["hi"], max_new_tokens=2)[0] == 0
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert generate(config, tmp_path / "b.jsonl", prompts=["hi"], max_new_tokens=2)[0] == 0
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
