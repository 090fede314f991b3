"""`training.stage: rm` (reward model) on a tiny Qwen3 (configs/qwen3/rm_lora.yaml, in this process).

The loss and rewards against a float64 hand computation; a LoRA run that trains, logs the reward
metrics and evaluates its validation pairs; resume bitwise; and the exported
`AutoModelForSequenceClassification` folder scoring like meshforge (transformers' scores at the
last non-pad token vs meshforge's rewards at each segment's last token).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import read_metrics
from tests.distributed._layouts import train_one
from tests.unit.test_dpo_train import REWARDS, TINY  # the same tiny pair runs

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3" / "rm_lora.yaml"
FULL = ["--lora_config=null", "--lr_scheduler.learning_rate=1e-3"]
LLAMA = [
    "--model.model_type=llama",
    "--model.architectures=LlamaForCausalLM",
    "--model.tie_word_embeddings=false",
]


def test_rewards_and_loss_match_a_float64_hand_computation():
    from meshforge.loss.reward import pair_rewards, pairwise_loss

    gen = torch.Generator().manual_seed(0)
    # Row 0: one pair (lengths 5, 3) and padding; row 1: two packed pairs; row 2: padding only.
    segments = torch.tensor(
        [
            [1, 1, 1, 1, 1, 2, 2, 2, 0, 0],
            [1, 1, 2, 2, 2, 3, 3, 3, 4, 4],
            [0] * 10,
        ]
    )
    hidden = torch.randn(3, 10, 16, generator=gen)
    weight = torch.randn(1, 16, generator=gen)
    rewards, present = pair_rewards(hidden, segments, weight)
    losses, metrics = pairwise_loss(rewards)
    h64, w64 = hidden.double(), weight.double()[0]
    want_pairs = []
    for row in range(3):
        for k in range(2):
            ends = [
                int((segments[row] == 2 * k + s).nonzero().max())
                for s in (1, 2)
                if (segments[row] == 2 * k + s).any()
            ]
            if len(ends) == 2:
                want_pairs.append([float(h64[row, e] @ w64) for e in ends])
    assert present.tolist() == [True, False, True, True, False, False]
    got = rewards[present].double()
    want = torch.tensor(want_pairs, dtype=torch.float64)
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) < 1e-6
    want_loss = torch.log1p(torch.exp(-(want[:, 0] - want[:, 1])))
    assert torch.linalg.norm(losses[present].double() - want_loss) / torch.linalg.norm(want_loss) < 1e-6
    assert torch.equal(metrics["rewards/accuracies"][present], (got[:, 0] > got[:, 1]).float())
    # The gradient reaches the head and the hidden states.
    w = weight.clone().requires_grad_(True)
    r, p = pair_rewards(hidden, segments, w)
    pairwise_loss(r)[0][p].mean().backward()
    d = want[:, 0] - want[:, 1]
    ends = [(0, 4, 0, 7), (1, 1, 1, 4), (1, 7, 1, 9)]
    want_grad = sum(
        -torch.sigmoid(-d[i]) * (h64[a, b] - h64[c, e]) for i, (a, b, c, e) in enumerate(ends)
    ) / len(ends)
    assert w.grad is not None
    assert torch.linalg.norm(w.grad[0].double() - want_grad) / torch.linalg.norm(want_grad) < 1e-6
    assert F.logsigmoid(torch.tensor(0.0)).item() == pytest.approx(-math.log(2))


def _meshforge_rewards(step: Path, segments: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rewards of a pair row, from the step's weights loaded as the export loads them."""
    from meshforge.checkpoint.offline import one_rank_group
    from meshforge.checkpoint.source import grown_options, resolve_model_source
    from meshforge.config import load_config
    from meshforge.train.reward import RewardStep
    from meshforge.train.reward_export import load_reward_step

    cfg = load_config(str(step.parent.parent / "config.yaml"), [])
    source = resolve_model_source(cfg.model, log=lambda _: None)
    options = grown_options(cfg.model, source, None, lambda _: None)
    with one_rank_group():
        model = load_reward_step(cfg, source, options, step, torch.float32, lambda _: None)
        step_fn = RewardStep(compute_dtype=torch.float32, autocast=False, device=torch.device("cpu"))
        rewards, _ = step_fn.rewards(model, {"input_ids": ids, "segment_ids": segments})
    return rewards[0].double()


def _transformers_scores(folder: Path, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """transformers' scores of the two sequences, in one right-padded batch."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    batch = torch.full((2, max(len(chosen), len(rejected))), pad)
    batch[0, : len(chosen)], batch[1, : len(rejected)] = chosen, rejected
    mask = (batch != pad).long()
    with torch.no_grad():
        return model(input_ids=batch, attention_mask=mask).logits[:, 0].double()


def _check_export(folder: Path, step: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["num_labels"] == 1 and config["pad_token_id"] is not None
    assert config["architectures"][0].endswith("ForSequenceClassification")
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names every key
        keys = set(json.loads(index.read_text())["weight_map"])
    else:
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
    assert "score.weight" in keys and "lm_head.weight" not in keys
    gen = torch.Generator().manual_seed(1)
    pad = config["pad_token_id"]
    chosen, rejected = (
        torch.randint(10, 8000, (13,), generator=gen),
        torch.randint(10, 8000, (7,), generator=gen),
    )
    chosen[chosen == pad], rejected[rejected == pad] = 11, 11
    ids = torch.cat([chosen, rejected])[None]
    segments = torch.tensor([[1] * 13 + [2] * 7])
    ours = _meshforge_rewards(step, segments, ids)
    theirs = _transformers_scores(folder, chosen, rejected)
    assert torch.linalg.norm(ours - theirs) / torch.linalg.norm(theirs) < 1e-5, (ours, theirs)


def test_lora_run_logs_rewards_evaluates_and_exports(tmp_path):
    out = tmp_path / "run"
    extra = [
        "--train_dataset.max_samples=12",
        "--train_dataset.val_size=4",
        "--training.eval_interval=3",
        "--checkpoint.save_hf_weights=true",
        "--kernels.chunk_loss_size=16",  # an LM-loss setting: said to have no effect
    ]
    run = train_one(
        CONFIG, [*TINY, *extra, "--training.steps=3", f"--training.output_dir={out}"], cwd=tmp_path
    )
    assert "reward model: value head score [64 -> 1]" in run.stdout
    assert "warning: kernels.chunk_loss_size: no effect with training.stage: rm" in run.stdout
    records = read_metrics(out)
    assert all(r["pairs"] == 8 and all(k in r for k in REWARDS) and "logps/chosen" not in r for r in records)
    losses = [r["loss"] for r in records]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    # The loss is the mean of -logsigmoid(margin) over the pairs: at least -logsigmoid(mean margin).
    first = records[0]
    assert first["loss"] >= -F.logsigmoid(torch.tensor(first["rewards/margins"])).item() - 1e-6
    assert "rewards chosen" in run.stdout and "logps" not in run.stdout
    last = records[-1]
    assert last["eval_pairs"] == 4 and math.isfinite(last["eval_loss"])
    assert 0.0 <= last["eval_rewards/accuracies"] <= 1.0 and "eval_rewards/margins" in last
    step = out / "checkpoints" / "checkpoint-00000003"
    _check_export(out / "hf", step)  # checkpoint.save_hf_weights: from memory, adapters merged
    from meshforge.train.export import dcp_to_hf

    _check_export(dcp_to_hf(step, tmp_path / "converted", log=lambda _: None), step)  # convert --to hf


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_convert_writes_a_sequence_classification_folder(tmp_path, family):
    from meshforge.train.export import dcp_to_hf

    out = tmp_path / "run"
    extra = [*FULL, *(LLAMA if family == "llama" else []), "--training.steps=1"]
    train_one(CONFIG, [*TINY, *extra, f"--training.output_dir={out}"], cwd=tmp_path)
    step = out / "checkpoints" / "checkpoint-00000001"
    # llama: untied, in shards (the LM head left out of its shard, the head added to it).
    shard = "1MB" if family == "llama" else "5GB"
    folder = dcp_to_hf(step, tmp_path / "hf", shard_size=shard, log=lambda _: None)
    assert (folder / "model.safetensors.index.json").is_file() == (family == "llama")
    _check_export(folder, step)


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_resume_is_bitwise(tmp_path, tuning):
    whole, first = tmp_path / "whole", tmp_path / "first"
    # Full fine-tuning with an untied LM head: frozen (a reward model never runs it), so the resumed
    # optimizer expects no state for it.
    full = [*FULL, "--model.tie_word_embeddings=false"]
    base = [
        *TINY,
        *(full if tuning == "full" else []),
        "--train_dataset.max_samples=16",
        "--training.steps=4",
    ]
    train_one(CONFIG, [*base, f"--training.output_dir={whole}"], cwd=tmp_path)
    train_one(
        CONFIG,
        [*base, f"--training.output_dir={first}", "--checkpoint.save_interleaved_steps=2"],
        cwd=tmp_path,
    )
    resumed = tmp_path / "resumed"
    step2 = first / "checkpoints" / "checkpoint-00000002"
    train_one(
        CONFIG, [*base, f"--training.output_dir={resumed}", f"--checkpoint.load_path={step2}"], cwd=tmp_path
    )
    keys = ("loss", "grad_norm", "pairs", *REWARDS)
    want = [{k: r[k] for k in keys} for r in read_metrics(whole)]
    assert [{k: r[k] for k in keys} for r in read_metrics(resumed)] == want[2:]


def test_llamafactory_reward_example_trains(tmp_path, monkeypatch):
    """LLaMA-Factory's reward LoRA example (`stage: rm`) on its own dpo_en_demo pairs, unchanged but
    for the model path, the step count, its 16 encoding processes and a shorter cutoff_len."""
    import shutil

    from tests.conftest import train_here
    from tests.unit.test_hf_interop import _save_hf_model

    lf = REPO / "tests" / "data" / "llamafactory"
    hf = _save_hf_model(
        tmp_path / "Qwen3-tiny", tied=False, shard=None, seed=3, options={"max_position_embeddings": 2048}
    )
    shutil.copytree(lf / "data", tmp_path / "data")
    text = (lf / "examples" / "train_lora" / "qwen3_lora_reward.yaml").read_text(encoding="utf-8")
    edits = {
        "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507": f"model_name_or_path: {hf}",
        "num_train_epochs: 3.0": "max_steps: 1",
        "preprocessing_num_workers: 16\n": "",
        "cutoff_len: 2048": "cutoff_len: 256",  # pair rows of 512 tokens, not 4096 (CPU time)
    }
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "qwen3_lora_reward.yaml"
    config.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    train_here(config, [], log=lines.append)
    assert any("reward model: value head score" in s for s in lines), lines
    records = read_metrics(tmp_path / "saves" / "qwen3-4b" / "lora" / "reward")
    assert [r["step"] for r in records] == [1]
    assert all(r["pairs"] == 8 and math.isfinite(r["loss"]) and all(k in r for k in REWARDS) for r in records)
