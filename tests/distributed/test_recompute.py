"""Recompute and communication recompute in every 2-rank layout: the same numbers, less held.

One spawn of 2 gloo processes runs each case as real trainings through the `Trainer` (two
steps, deterministic mode): without recompute, then with each mode; the losses and gradient
norms must be bitwise equal (a recomputed region runs the same kernels and collectives on the
same inputs). qwen3 runs in every dense layout in every mode (kept matmuls in all but ZBV,
where they are refused): FSDP dp2, tp2 with `recompute_comm` (alone, with full, select and
kept-matmul recompute on the same layers), cp2 (Ulysses), pp2 with 1f1b and with the zero-bubble
ZBV schedule (split input/weight backward). The other families run where their own modules meet the wrapping, one or
two modes each (`FAMILY_MODES`): qwen3_moe under ep2 (whole layers, and the routed experts alone)
and ZBV, deepseek_v3's MLA under tp2 (with `recompute_comm`), cp2 and ep2, qwen3_next's Gated
DeltaNet under tp2 (with `recompute_comm`), dp2 and 1f1b (every family is checked in every mode
on one process in `tests/unit/test_recompute.py`); the generic transformers path with dp2, tp2
and pp2. A module that does not read a gathered input is refused for communication recompute,
naming the key.

Under tp2 the bytes autograd holds for backward (`SavedTensorLedger`) show the communication
recompute's saving on qwen3, deepseek_v3 (MLA's first projections) and qwen3_next (Gated
DeltaNet's input projections, gated attention, MoE blocks): each selected all-gathered input is
held as its sequence shard, exactly half its bytes on 2 ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshforge.memory.ledger import SavedTensorLedger
from tests.conftest import REPO, TINY_CONFIG, write_corpus
from tests.distributed._spawn import run_workers
from tests.unit.test_recompute import family_overrides, train_records

pytestmark = pytest.mark.slow

FULL = ["--recompute.mode=full", "--recompute.full_recompute_layer=['0-3']"]
SELECT = ["--recompute.mode=select", "--recompute.select_module={'attention': ['0-1'], 'mlp': ['2-3']}"]
KEEP_MM = [
    "--recompute.mode=full",
    "--recompute.full_recompute_layer=['1-2']",
    "--recompute.exclude_op=['matmul']",
]
COMM = [
    "--recompute_comm.enable=true",
    "--recompute_comm.select_module={'attention.qkv': ['0-3'], 'mlp': ['0-2']}",
]
TP2 = ["--parallelism.tensor_parallel=2"]
PP2 = ["--parallelism.pipeline_parallel=2"]


ZBV = [
    *PP2,
    "--parallelism.pipeline_parallel_schedule=zbv",
    "--parallelism.pipeline_parallel_interleave_num=2",
]
# Layout -> overrides; every family runs in every layout it supports.
LAYOUTS: dict[str, list[str]] = {
    "dp2": [],
    "tp2": TP2,
    "cp2": ["--parallelism.context_parallel=2", "--parallelism.context_parallel_method=ulysses"],
    "pp2 1f1b": PP2,
    "pp2 zbv": ZBV,
    "ep2": ["--parallelism.expert_parallel=2"],
}
# The layouts each family runs in: where its own modules (experts, MLA, Gated DeltaNet) meet them.
FAMILY_LAYOUTS: dict[str, tuple[str, ...]] = {
    "qwen3": ("dp2", "tp2", "cp2", "pp2 1f1b", "pp2 zbv"),
    "qwen3_moe": ("ep2", "pp2 zbv"),
    "deepseek_v3": ("tp2", "cp2", "ep2"),
    "qwen3_next": ("tp2", "dp2", "pp2 1f1b"),
}
EXPERTS = ["--recompute.mode=select", "--recompute.select_module={'mlp.experts': ['1-3']}"]


def _modes(layout: str) -> list[tuple[str, list[str]]]:
    """Every mode that applies in the layout (qwen3's set)."""
    if layout == "tp2":
        return [
            ("comm", COMM),
            ("comm+full", [*COMM, *FULL]),
            ("comm+select", [*COMM, *SELECT]),
            ("comm+keep mm", [*COMM, *KEEP_MM]),
        ]
    modes = [("full", FULL), ("select", SELECT)]
    if layout != "pp2 zbv":  # one backward per selective-checkpoint region (refused there)
        modes.append(("keep mm", KEEP_MM))
    return modes


# The other families' modes per layout: each wraps the family's own modules in that layout once
# (the mode machinery itself is qwen3's, checked above in every mode; every family in every mode
# on one process in tests/unit/test_recompute.py).
FAMILY_MODES: dict[tuple[str, str], list[tuple[str, list[str]]]] = {
    ("qwen3_moe", "ep2"): [("full", FULL), ("experts", EXPERTS)],
    ("qwen3_moe", "pp2 zbv"): [("select", SELECT)],
    ("deepseek_v3", "tp2"): [("comm+select", [*COMM, *SELECT])],
    ("deepseek_v3", "cp2"): [("select", SELECT)],
    ("deepseek_v3", "ep2"): [("full", FULL), ("experts", EXPERTS)],
    ("qwen3_next", "tp2"): [("comm+full", [*COMM, *FULL])],
    ("qwen3_next", "dp2"): [("select", SELECT)],
    ("qwen3_next", "pp2 1f1b"): [("keep mm", KEEP_MM)],
}


def _cases(root: Path) -> list[tuple[str, Path, list[str], list[tuple[str, list[str]]]]]:
    """(name, config, layout overrides, [(mode name, overrides)])."""
    corpus = f"--train_dataset.dataloader.data_path={root / 'corpus.jsonl'}"
    families: dict[str, tuple[Path, list[str]]] = {
        "qwen3": (root / "tiny.yaml", ["--model.num_hidden_layers=4"])
    }
    for name in ("qwen3_moe", "deepseek_v3", "qwen3_next"):
        families[name] = (REPO / "configs" / name / "tiny.yaml", [*family_overrides(name), corpus])
    cases = []
    for family, (config, small) in families.items():
        for layout in FAMILY_LAYOUTS[family]:
            modes = _modes(layout) if family == "qwen3" else FAMILY_MODES[family, layout]
            cases.append((f"{family} {layout}", config, [*small, *LAYOUTS[layout]], modes))
    # The generic path (2 layers; its TP has no sequence parallelism, so no communication recompute).
    generic = root / "generic.yaml"
    whole = [("full", ["--recompute.mode=full", "--recompute.modules=['model.layers.{*}']"])]
    select = [
        (
            "select",
            ["--recompute.mode=select", "--recompute.select_module={'attention': ['0'], 'mlp': ['1']}"],
        )
    ]
    one_row = ["--training.local_batch_size=1"]
    cases.append(("generic dp2", generic, one_row, [*whole, *select]))
    cases.append(("generic tp2", generic, [*one_row, *TP2], whole))
    cases.append(("generic pp2 1f1b", generic, [*one_row, *PP2], select))
    return cases


def _held_bytes_under_tp2(config: Path, overrides: list[str], out: Path) -> int:
    """Bytes held for backward by one forward on this TP rank (parameters excluded)."""
    from meshforge.config import load_config
    from meshforge.train.trainer import Trainer

    cfg = load_config(
        str(config), [*overrides, *TP2, "--checkpoint.enable_save=false", f"--training.output_dir={out}"]
    )
    trainer = Trainer(cfg, log=lambda _line: None)
    trainer.setup()
    try:
        batch = trainer._to_device(next(trainer.data_iter))
        ledger = SavedTensorLedger()
        ledger.exclude(trainer.model.parameters())
        with ledger.recording():
            loss = trainer._loss_sum(batch)
        loss.backward()  # the re-gathers run here, in the same order on both ranks
    finally:
        trainer.close()
    return ledger.device_bytes


def _worker(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    folder = Path(root)
    failures: list[str] = []
    for name, config, layout, modes in _cases(folder):
        out = folder / name.replace(" ", "_")
        want = train_records(config, layout, out / "none")
        for mode, extra in modes:
            logs: list[str] = []
            got = train_records(config, [*layout, *extra], out / mode.replace(" ", "_"), log=logs.append)
            if got != want:
                failures.append(f"{name} {mode}: {got} != {want}")
            applied = [line for line in logs if line.startswith("activation memory:")]
            if not applied or "nothing applied" in applied[0]:
                failures.append(f"{name} {mode}: nothing applied ({applied})")
            elif "recompute_comm" in " ".join(extra) and "recompute_comm" not in applied[0]:
                failures.append(f"{name} {mode}: no communication recompute in {applied[0]}")
    # A module whose input is not the gathered sequence (o_proj reads the attention's output).
    wrong = ["--recompute_comm.enable=true", "--recompute_comm.select_module={'self_attn.o_proj': ['0']}"]
    try:
        train_records(folder / "tiny.yaml", ["--model.num_hidden_layers=4", *TP2, *wrong], folder / "wrong")
        failures.append("tp2: recompute_comm on o_proj was accepted")
    except ValueError as err:
        if "recompute_comm.select_module.self_attn.o_proj" not in str(err):
            failures.append(f"tp2: recompute_comm on o_proj: {err}")
    corpus = f"--train_dataset.dataloader.data_path={folder / 'corpus.jsonl'}"
    for family, config, overrides in (
        ("qwen3", folder / "tiny.yaml", ["--model.num_hidden_layers=4"]),
        (
            "deepseek_v3",
            REPO / "configs" / "deepseek_v3" / "tiny.yaml",
            [*family_overrides("deepseek_v3"), corpus],
        ),
        (
            "qwen3_next",
            REPO / "configs" / "qwen3_next" / "tiny.yaml",
            [*family_overrides("qwen3_next"), corpus],
        ),
    ):
        out = folder / f"ledger_{family}"
        plain = _held_bytes_under_tp2(config, overrides, out)
        comm = _held_bytes_under_tp2(config, [*overrides, *COMM], out)
        if rank == 0:
            print(f"tp2 {family}: held for backward {plain} bytes, with recompute_comm {comm}", flush=True)
        # Each of the 7 gathered inputs COMM names (q/k/v of 4 layers, MLP of 3) is held as its
        # half instead of whole: micro-batch 2 x sequence 32 x hidden 64 float32 values.
        gathered = 2 * 32 * 64 * 4
        if plain - comm != 7 * gathered // 2:
            failures.append(
                f"tp2 {family}: recompute_comm holds {comm} bytes, without it {plain}; expected "
                f"{7 * gathered // 2} less"
            )
    assert not failures, "\n".join(failures)


def test_recompute_in_every_layout_equals_no_recompute(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, TRAIN_YAML

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.format(data=corpus))
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**MISTRAL)).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    (tmp_path / "generic.yaml").write_text(TRAIN_YAML.format(data=corpus, model=hf_dir, extra=""))
    run_workers(_worker, 2, str(tmp_path), timeout=1500)
