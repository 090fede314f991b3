"""LoRA through the trainer on a tiny HF qwen3 folder: what is saved, resume, exports, starting points.

The runs are in-process (one-rank group) and tiny: 2 layers, hidden 32, sequences of 32 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from meshforge.checkpoint.dcp_reader import read_dcp_metadata
from meshforge.checkpoint.lora_base import is_adapter_parameter, weights_digest
from meshforge.config import ConfigError, load_config
from meshforge.train.trainer import Trainer
from tests._compare import rel_error
from tests.conftest import read_metrics, write_corpus
from tests.unit.test_hf_interop import HF_OPTIONS, _save_hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

YAML = """
training:
  steps: 4
  local_batch_size: 2
  global_batch_size: 2
  seed: 5
  deterministic: true
lr_scheduler:
  type: ConstantWarmUpLR
  learning_rate: 2.e-2
  warmup_steps: 0
train_dataset:
  dataloader:
    type: TextDataLoader
    data_path: {data}
    seq_length: 32
    shuffle: true
model:
  model_name_or_path: {hf}
checkpoint:
  save_interleaved_steps: 2
lora_config:
  target_modules: '.*(q_proj|v_proj|down_proj)'
  lora_rank: 4
  lora_alpha: 8
  lora_b_std: 0.01
"""


def _train(config: Path, overrides: list[str], *, steps: bool = True) -> Trainer:
    trainer = Trainer(load_config(str(config), overrides), log=lambda _msg: None)
    trainer.setup()
    if steps:
        trainer.train()
    return trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    hf = _save_hf_model(root / "hf", tied=False, shard=None, seed=3)
    config = root / "lora.yaml"
    config.write_text(YAML.format(data=write_corpus(root / "corpus.jsonl", num_docs=40), hf=hf))
    run = root / "run"
    trainer = _train(config, [f"training.output_dir={run}", "checkpoint.save_hf_weights=true"])
    return {"root": root, "hf": hf, "config": config, "run": run, "trainer": trainer}


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"checkpoint-{step:08d}"


def _ids() -> torch.Tensor:
    return torch.randint(0, HF_OPTIONS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(9))


def test_only_adapters_train_and_only_they_are_saved(setup: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    model = setup["trainer"].model
    stored = load_file(str(setup["hf"] / "model.safetensors"))
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(is_adapter_parameter(n) for n in adapters)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param.detach(), stored[name]), name  # the base is bitwise unchanged
    params = dict(model.named_parameters())
    assert all(float(params[n].detach().abs().sum()) > 0 for n in adapters)
    step = _step(setup["run"], 4)
    keys = read_dcp_metadata(step).state_dict_metadata
    model_keys = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    assert sorted(model_keys) == sorted(adapters)
    assert any(k.startswith("optimizer.state.") for k in keys)
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["lora"]["base"] == {
        "kind": "hf",
        "path": str(setup["hf"]),
        "sha256": weights_digest(setup["hf"], "hf"),
    }


def test_resume_is_bitwise(setup: dict[str, Any]) -> None:
    out = setup["root"] / "resumed"
    _train(setup["config"], [f"training.output_dir={out}", f"checkpoint.load_path={_step(setup['run'], 2)}"])
    full, resumed = read_metrics(setup["run"]), read_metrics(out)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[2:]]


def test_peft_and_merged_exports_give_our_logits(setup: dict[str, Any]) -> None:
    model = setup["trainer"].model.eval()
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32).eval()
        plain = base(ids).logits
        # from_pretrained puts the adapters into `base` itself.
        with_peft = peft.PeftModel.from_pretrained(base, setup["run"] / "adapter").eval()
        assert rel_error(ours, with_peft(ids).logits) <= 1e-5
        merged = transformers.AutoModelForCausalLM.from_pretrained(setup["run"] / "hf", dtype=torch.float32)
        assert rel_error(ours, merged.eval()(ids).logits) <= 1e-5
        # The adapters change the output: the check above is not the base against itself.
        assert rel_error(plain, ours) > 1e-4
    # Written with the process's umask (the safetensors library alone would make them 0600).
    expected = 0o666 & ~_current_umask()
    for file in [
        setup["run"] / "adapter" / "adapter_model.safetensors",
        *(setup["run"] / "hf").glob("*.safetensors"),
    ]:
        assert file.stat().st_mode & 0o777 == expected, file


def _current_umask() -> int:
    import os

    current = os.umask(0o022)
    os.umask(current)
    return current


def test_convert_writes_the_same_merged_folder_and_adapter(setup: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    from meshforge.cli.main import main

    out = setup["root"] / "converted"
    assert main(["convert", "--to", "hf", str(_step(setup["run"], 4)), str(out)]) == 0
    for a, b in (
        (out / "model.safetensors", setup["run"] / "hf" / "model.safetensors"),
        (
            out / "adapter" / "adapter_model.safetensors",
            setup["run"] / "adapter" / "adapter_model.safetensors",
        ),
    ):
        left, right = load_file(str(a)), load_file(str(b))
        assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_peft_adapter_continues_training(setup: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    # An adapter written by peft itself (save_pretrained) starts a new run's adapters.
    base = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    twin = peft.PeftModel.from_pretrained(base, setup["run"] / "adapter", is_trainable=True)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if "lora_B" in name:
                param.mul_(1.5)
    folder = setup["root"] / "peft_made"
    twin.save_pretrained(folder)
    stored = load_file(str(folder / "adapter_model.safetensors"))
    trainer = _train(
        setup["config"],
        [f"training.output_dir={setup['root'] / 'cont'}", f"lora_config.adapter_path={folder}"],
        steps=False,
    )
    params = dict(trainer.model.named_parameters())
    assert len(stored) == len([n for n in params if is_adapter_parameter(n)])
    for key, tensor in stored.items():
        assert torch.equal(params[key.removeprefix("base_model.model.")].detach(), tensor), key
    trainer.close()


def test_wrong_adapters_are_named(setup: dict[str, Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    body = json.loads((setup["run"] / "adapter" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(dict(body, r=8)))
    with pytest.raises(ValueError, match=r"adapter_config.json: r is 8 but lora_config.lora_rank is 4"):
        _train(setup["config"], [f"training.output_dir={tmp_path / 'x'}", f"lora_config.adapter_path={bad}"])
    from safetensors.torch import load_file, save_file

    (bad / "adapter_config.json").write_text(json.dumps(body))
    tensors = load_file(str(setup["run"] / "adapter" / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 4, 4)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(
        ValueError, match=r"adapter_model.safetensors: .*q_proj.lora_B.weight' has shape \(36, 4\)"
    ):
        _train(setup["config"], [f"training.output_dir={tmp_path / 'y'}", f"lora_config.adapter_path={bad}"])
    with pytest.raises(ConfigError, match=r"lora_config.lora_rank: must be positive, got 0"):
        load_config(str(setup["config"]), ["lora_config.lora_rank=0"])


def test_full_run_step_is_the_base_of_new_adapters(setup: dict[str, Any]) -> None:
    root = setup["root"]
    full = root / "full_run"
    _train(setup["config"], [f"training.output_dir={full}", "training.steps=2", "lora_config=null"])
    out = root / "on_full"
    trainer = _train(
        setup["config"],
        [f"training.output_dir={out}", "training.steps=2", f"checkpoint.load_path={_step(full, 2)}"],
    )
    state = json.loads((_step(out, 2) / "trainer_state.json").read_text())
    assert state["lora"]["base"]["kind"] == "dcp" and state["lora"]["base"]["path"] == str(_step(full, 2))
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    # The frozen base equals the full run's trained weights (not the HF folder's).
    from safetensors.torch import load_file

    stored = load_file(str(setup["hf"] / "model.safetensors"))
    frozen = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert any(not torch.equal(p.detach(), stored[n]) for n, p in frozen.items())
    # Resuming those adapters loads their base from the full run's step again (recorded, hashed).
    resumed = _train(
        setup["config"],
        [
            f"training.output_dir={root / 'on_full_resumed'}",
            "training.steps=3",
            f"checkpoint.load_path={_step(out, 2)}",
        ],
    )
    assert resumed.step == 3
    again = dict(resumed.model.named_parameters())
    assert all(torch.equal(again[n].detach(), p.detach()) for n, p in frozen.items())
    from meshforge.cli.main import main

    merged = root / "on_full_hf"
    assert main(["convert", "--to", "hf", str(_step(out, 2)), str(merged)]) == 0
    ids = _ids()
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        assert rel_error(trainer.model.eval()(ids), hf(ids).logits) <= 1e-5


def test_generate_uses_the_adapters(tmp_path: Path) -> None:
    from tests.unit._generate_fixtures import PROMPTS, generate, hf_greedy, save_family, write_config

    hf = save_family(tmp_path / "hf", "qwen3")
    train = tmp_path / "lora.yaml"
    train.write_text(YAML.format(data=write_corpus(tmp_path / "corpus.jsonl", num_docs=20), hf=hf))
    run = tmp_path / "run"
    _train(train, [f"training.output_dir={run}", "training.steps=2", "checkpoint.save_hf_weights=true"])
    config = write_config(tmp_path / "gen.yaml", f"  model_name_or_path: {hf}\n")
    lora = "lora_config:\n  target_modules: '.*(q_proj|v_proj|down_proj)'\n  lora_rank: 4\n  lora_alpha: 8\n"
    config.write_text(config.read_text() + lora + f"checkpoint:\n  load_path: {_step(run, 2)}\n")
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    reference = hf_greedy(run / "hf", prompts, 6)
    assert reference != hf_greedy(hf, prompts, 6)  # the adapters change the tokens
    rc, _, rows = generate(config, tmp_path / "out.jsonl", prompts=PROMPTS, max_new_tokens=6)
    assert rc == 0 and [r["token_ids"] for r in rows] == reference


@pytest.mark.parametrize(
    ("family", "target"),
    [("llama", ".*(q_proj|o_proj|up_proj)"), ("mistral", ".*(k_proj|gate_proj)"), ("qwen3_moe", "all")],
)
def test_families_and_generic_path_export_to_peft(family: str, target: str, tmp_path: Path) -> None:
    from tests.unit._generate_fixtures import save_family

    hf = save_family(tmp_path / "hf", family)
    config = tmp_path / "lora.yaml"
    text = YAML.format(data=write_corpus(tmp_path / "corpus.jsonl", num_docs=20), hf=hf)
    config.write_text(text.replace("'.*(q_proj|v_proj|down_proj)'", f"'{target}'"))
    run = tmp_path / "run"
    trainer = _train(
        config, [f"training.output_dir={run}", "training.steps=2", "checkpoint.enable_save=false"]
    )
    adapted = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert adapted and all(is_adapter_parameter(n) for n in adapted)
    if family == "qwen3_moe":
        # `all`: the attention projections; the router and the fused experts are no nn.Linear.
        assert len(adapted) == 2 * 2 * 4 and not any(".mlp." in n for n in adapted)
    ids = _ids()
    with torch.no_grad():
        ours = trainer.model.eval()(ids)
        ours = ours.logits if hasattr(ours, "logits") else ours
        base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        plain = base(ids).logits
        with_peft = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
        assert rel_error(ours, with_peft(ids).logits) <= 1e-5
        assert rel_error(ours, plain) > 1e-4


def test_recompute_and_chunked_loss_give_the_same_steps(setup: dict[str, Any], tmp_path: Path) -> None:
    from tests.unit.test_recompute import train_records

    config = setup["config"]
    plain = train_records(config, ["--lora_config.lora_dropout=0.1"], tmp_path / "plain")
    for extra in (
        ["--recompute.mode=full", "--recompute.full_recompute_layer=['0-1']"],
        ["--recompute.mode=select", "--recompute.select_module={'attention': ['0-1']}"],
    ):
        # Dropout on the adapter input: recompute must replay the same masks.
        got = train_records(config, ["--lora_config.lora_dropout=0.1", *extra], tmp_path / "r")
        assert got == plain, extra
    chunked = train_records(
        config, ["--lora_config.lora_dropout=0.1", "--kernels.chunk_loss_size=8"], tmp_path / "c"
    )
    a, b = torch.tensor(chunked, dtype=torch.float64), torch.tensor(plain, dtype=torch.float64)
    assert ((a - b).norm() / b.norm()).item() <= 1e-6
