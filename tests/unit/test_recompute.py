"""Activation recompute in one process: same numbers, fewer saved bytes, clear errors.

Each mode (full layers, MindSpeed module patterns, selected submodules with the reference's
words and with transformers' names, kept operators) trains two real steps through the
`Trainer` with losses and gradient norms bitwise equal to the run without it (deterministic
mode; the recomputation runs the same kernels on the same inputs), on qwen3, qwen3_moe,
deepseek_v3, qwen3_next and the generic transformers path. The saving is measured as the bytes
autograd holds for backward (`SavedTensorLedger`): full recompute of every layer keeps a small
fraction, attention-only and MLP-only sit in between. Bad keys fail before the model is built
where the config alone tells, otherwise when the model is wrapped, each naming its key.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshforge.config import ConfigError, load_config
from meshforge.memory.config import RecomputeConfig
from meshforge.memory.ledger import SavedTensorLedger
from meshforge.memory.recompute import apply_recompute, checkpoint_module, resolve_kept, resolve_ops
from meshforge.train.trainer import Trainer
from tests.conftest import REPO, write_corpus

FAMILY_CONFIGS = {
    name: REPO / "configs" / name / "tiny.yaml" for name in ("qwen3_moe", "deepseek_v3", "qwen3_next")
}
# Small enough for a few steps on one CPU core; the same micro-batches in every layout.
SMALL = [
    "--train_dataset.dataloader.seq_length=32",
    "--training.local_batch_size=2",
    "--training.global_batch_size=4",
    "--model.num_hidden_layers=4",
    "--model.hidden_size=64",
    "--model.intermediate_size=128",
    "--model.moe_intermediate_size=32",
]
SMALL_BY_FAMILY = {
    "qwen3_moe": ["--model.head_dim=16"],
    "deepseek_v3": [
        "--model.q_lora_rank=32",
        "--model.kv_lora_rank=16",
        "--model.qk_nope_head_dim=16",
        "--model.qk_rope_head_dim=8",
        "--model.v_head_dim=16",
    ],
    "qwen3_next": [
        "--model.head_dim=16",
        "--model.linear_key_head_dim=16",
        "--model.linear_value_head_dim=16",
        "--model.shared_expert_intermediate_size=64",
    ],
}


def family_overrides(family: str) -> list[str]:
    """A 4-layer model of ``family`` with small widths (layers keep the family's kinds)."""
    return [*SMALL, *SMALL_BY_FAMILY[family]]


# (name, overrides) of each mode, for a 4-layer model.
MODES: list[tuple[str, list[str]]] = [
    ("full", ["--recompute.mode=full", "--recompute.full_recompute_layer=['0-3']"]),
    ("modules", ["--recompute.mode=full", "--recompute.modules=['model.layers.{1-2}']"]),
    (
        "select",
        ["--recompute.mode=select", "--recompute.select_module={'attention': ['0-1'], 'mlp': ['2-3']}"],
    ),
    (
        "full+exclude_op",
        [
            "--recompute.mode=full",
            "--recompute.full_recompute_layer=['0','2-3']",
            "--recompute.exclude_op=['matmul/2', 'aten._softmax.default']",
        ],
    ),
]


def train_records(
    config: Path, overrides: list[str], out: Path, *, steps: int = 2, log: Callable[[str], None] | None = None
) -> list[tuple[float, float]]:
    """`(loss, grad_norm)` of each step of a real training (no checkpoints), in this process."""
    cfg = load_config(
        str(config),
        [
            f"--training.steps={steps}",
            "--training.deterministic=true",
            "--checkpoint.enable_save=false",
            f"--training.output_dir={out}",
            *overrides,
        ],
    )
    trainer = Trainer(cfg, log=log or (lambda _line: None))
    trainer.setup()
    try:
        records = [trainer.train_step() for _ in range(steps)]
    finally:
        trainer.close()
    return [(r["loss"], r["grad_norm"]) for r in records]


def assert_same_runs(
    config: Path, base: list[str], modes: list[tuple[str, list[str]]], out: Path, *, what: str
) -> None:
    """Each mode's steps equal the run without recompute, bitwise; the summary line says what ran."""
    want = train_records(config, base, out / "none")
    for name, extra in modes:
        logs: list[str] = []
        got = train_records(config, [*base, *extra], out / name.replace("+", "_"), log=logs.append)
        assert got == want, (what, name, got, want)
        summary = [line for line in logs if line.startswith("activation memory:")]
        assert summary and "nothing applied" not in summary[0], (what, name, logs)


def test_every_mode_trains_bitwise_like_no_recompute_on_qwen3(tiny_config: Path, tmp_path: Path) -> None:
    words = (
        "select transformers names",
        [
            "--recompute.mode=select",
            "--recompute.select_module={'self_attn': ['0'], 'mlp\\.(gate|up)_proj': ['1']}",
        ],
    )
    assert_same_runs(
        tiny_config,
        ["--model.num_hidden_layers=4"],
        [*MODES, words],
        tmp_path,
        what="qwen3",
    )


def test_recompute_composes_with_chunked_micro_batches_and_the_chunked_loss(
    tiny_config: Path, tmp_path: Path
) -> None:
    modes = [MODES[0], MODES[2]]
    chunks = ["--parallelism.enable_chunk_batch=true", "--parallelism.chunk_mbs=2"]
    assert_same_runs(
        tiny_config, ["--model.num_hidden_layers=4", *chunks], modes, tmp_path / "c", what="chunks"
    )
    loss = ["--kernels.chunk_loss_size=16"]
    assert_same_runs(tiny_config, ["--model.num_hidden_layers=4", *loss], modes, tmp_path / "l", what="loss")


@pytest.mark.procs  # inductor compiles its C++ kernels in processes
def test_recompute_composes_with_compile(tiny_config: Path, tmp_path: Path) -> None:
    # A cold torch.compile of the blocks takes most of a minute here: one mode.
    assert_same_runs(
        tiny_config,
        ["--model.num_hidden_layers=4", "--kernels.compile=true"],
        [MODES[0]],
        tmp_path,
        what="compile",
    )


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_mode_trains_bitwise_like_no_recompute(family: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", num_docs=60)
    base = [*family_overrides(family), f"--train_dataset.dataloader.data_path={corpus}"]
    modes = list(MODES)
    modes.append(
        ("select experts", ["--recompute.mode=select", "--recompute.select_module={'mlp.experts': ['1-3']}"])
    )
    assert_same_runs(FAMILY_CONFIGS[family], base, modes, tmp_path, what=family)


def test_generic_path_trains_bitwise_like_no_recompute(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from meshforge.data.tokenizer import build_tokenizer
    from tests.unit.test_generic_hf import MISTRAL, _config

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**MISTRAL)).save_pretrained(hf_dir)
    build_tokenizer("meshforge://assets/tokenizer").save_pretrained(hf_dir)
    modes = [
        ("full", ["--recompute.mode=full", "--recompute.full_recompute_layer=['0-1']"]),
        ("modules", ["--recompute.mode=full", "--recompute.modules=['model.layers.{*}']"]),
        (
            "select",
            ["--recompute.mode=select", "--recompute.select_module={'attention': ['0'], 'mlp': ['1']}"],
        ),
    ]
    assert_same_runs(_config(tmp_path, hf_dir), [], modes, tmp_path, what="generic")


# --------------------------------------------------------------------------- saved bytes


def _saved_bytes(cfg: RecomputeConfig | None) -> int:
    """Bytes autograd holds after one forward of a 4-layer qwen3 whose activations dominate."""
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3

    args = Qwen3Args(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = build_qwen3(args, device="cpu")
    if cfg is not None:
        apply_recompute(model, cfg, num_layers=4)
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    ledger = SavedTensorLedger()
    ledger.exclude(model.parameters())
    with ledger.recording():
        logits = model(ids)
    del logits
    return ledger.device_bytes


def test_saved_bytes_fall_with_full_and_select_recompute() -> None:
    none = _saved_bytes(None)
    full = _saved_bytes(RecomputeConfig(mode="full", full_recompute_layer=["0-3"]))
    attention = _saved_bytes(RecomputeConfig(mode="select", select_module={"attention": ["0-3"]}))
    mlp = _saved_bytes(RecomputeConfig(mode="select", select_module={"mlp": ["0-3"]}))
    kept = _saved_bytes(RecomputeConfig(mode="full", full_recompute_layer=["0-3"], exclude_op=["matmul"]))
    every_other = _saved_bytes(
        RecomputeConfig(mode="full", full_recompute_layer=["0-3"], exclude_op=["matmul/2"])
    )
    half = _saved_bytes(RecomputeConfig(mode="full", full_recompute_layer=["0-1"]))
    assert full <= 0.15 * none, (full, none)
    assert full < attention < none and full < mlp < none, (full, attention, mlp, none)
    # Keeping the matmul outputs keeps part of each layer; half the layers save about half.
    assert full < kept < none, (full, kept, none)
    assert full < every_other < kept, (full, every_other, kept)
    assert full < half < none and half == pytest.approx((none + full) / 2, rel=0.1), (full, half, none)


# --------------------------------------------------------------------------- bad inputs

BASE_YAML = """
model: {{model_type: qwen3, num_hidden_layers: 4}}
train_dataset: {{dataloader: {{type: TextDataLoader, data_path: x.txt, seq_length: 8}}}}
recompute: {recompute}
"""


def _load(tmp_path: Path, recompute: str, section: str = "recompute") -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BASE_YAML.format(recompute=recompute).replace("recompute:", f"{section}:", 1))
    load_config(str(path))


@pytest.mark.parametrize(
    ("recompute", "key", "words"),
    [
        ("{mode: full, full_recompute_layer: ['0-4']}", "recompute.full_recompute_layer", "out of range"),
        ("{mode: select, select_module: {mlp: ['4']}}", "recompute.select_module.mlp", "out of range"),
        (
            "{mode: full, full_recompute_layer: ['0-1'], select_module: {attention: ['1-2']}}",
            "recompute.select_module.attention",
            "layer 1 is also in recompute.full_recompute_layer",
        ),
        (
            "{mode: select, select_module: {mlp: ['0']}, full_recompute_layer: ['1-0']}",
            "full_recompute_layer",
            "",
        ),
        ("{select_module: {mlp: ['0']}}", "recompute.select_module", "no effect"),
        (
            "{mode: full, full_recompute_layer: ['0'], exclude_op: ['mat mul']}",
            "recompute.exclude_op[0]",
            "not an operator",
        ),
        (
            "{mode: select, modules: ['model.layers.{*}'], select_module: {mlp: ['0']}}",
            "recompute.modules",
            "needs recompute.mode 'full'",
        ),
    ],
)
def test_bad_recompute_keys_fail_at_load(tmp_path: Path, recompute: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, recompute)
    assert key in str(err.value) and words in str(err.value), str(err.value)


def test_exclude_op_with_a_split_backward_schedule_fails_at_load(tmp_path: Path) -> None:
    path = tmp_path / "zbv.yaml"
    recompute = "{mode: full, full_recompute_layer: ['0'], exclude_op: [matmul]}"
    pp = "parallelism: {pipeline_parallel: 2, pipeline_parallel_schedule: ZBV, pipeline_parallel_interleave_num: 2}"
    path.write_text(BASE_YAML.format(recompute=recompute) + pp + "\n")
    with pytest.raises(ConfigError, match=r"recompute.exclude_op: .*one backward per region"):
        load_config(str(path))


def test_recompute_comm_select_module_without_enable_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recompute_comm.select_module.*no effect"):
        _load(tmp_path, "{select_module: {attention.qkv: ['0']}}", section="recompute_comm")


def _tiny_meta_qwen3() -> torch.nn.Module:
    from meshforge.models.qwen3.args import Qwen3Args
    from meshforge.models.qwen3.model import build_qwen3

    return build_qwen3(
        Qwen3Args(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
    )


@pytest.mark.parametrize(
    ("cfg", "key", "words"),
    [
        (
            RecomputeConfig(mode="select", select_module={"attn_typo": ["0"]}),
            "recompute.select_module.attn_typo",
            "matches no submodule of decoder layer(s) 0",
        ),
        (
            RecomputeConfig(mode="full", modules=["model.layer.{*}"]),
            "recompute.modules[0]",
            "matches no module",
        ),
        (
            RecomputeConfig(mode="full", full_recompute_layer=["0"], exclude_op=["aten.no_such_op"]),
            "recompute.exclude_op[0]",
            "not an aten operator",
        ),
        (
            RecomputeConfig(mode="full", full_recompute_layer=["0-5"]),
            "recompute.full_recompute_layer",
            "out of range [0, 3]",
        ),
        (
            RecomputeConfig(mode="full", modules=["model.layers.{0-1}"], select_module={"mlp": ["1"]}),
            "recompute.select_module.mlp",
            "also recomputed whole",
        ),
    ],
)
def test_bad_recompute_keys_fail_when_the_model_is_wrapped(
    cfg: RecomputeConfig, key: str, words: str
) -> None:
    with pytest.raises(ValueError) as err:
        apply_recompute(_tiny_meta_qwen3(), cfg, num_layers=4)
    assert key in str(err.value) and words in str(err.value), str(err.value)


def test_exclude_op_names_resolve_to_aten_operators() -> None:
    aten = torch.ops.aten
    assert resolve_ops(["aten.mm.default"]) == [aten.mm.default]
    assert resolve_ops(["mm"]) == [aten.mm] == resolve_ops(["aten.mm"])
    assert set(resolve_ops(["MatMul"])) == {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    assert aten._scaled_dot_product_flash_attention_for_cpu in resolve_ops(["flash_attention"])


def test_every_second_matmul_is_kept_and_the_gradients_do_not_change() -> None:
    """`matmul/2` keeps the outputs of the 1st and 3rd of four matmuls of a region (torchtitan's
    op policy), per region call: each call starts counting afresh."""
    torch.manual_seed(0)
    widths = [4, 3, 5, 7, 11]
    chain = torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False) for a, b in zip(widths, widths[1:])])
    x = torch.randn(2, 4)
    want = [g.clone() for g in torch.autograd.grad(chain(x).square().sum(), list(chain.parameters()))]
    checkpoint_module(chain, ops=resolve_kept(["mm/2"]))
    for _call in range(2):
        ledger = SavedTensorLedger()
        ledger.exclude(chain.parameters())
        with ledger.recording():
            out = chain(x)
        # The region's input and the outputs of the first and third matmul ([2, 3] and [2, 7]).
        assert ledger.device_bytes == 4 * (2 * 4 + 2 * 3 + 2 * 7), ledger.device_bytes
        got = torch.autograd.grad(out.square().sum(), list(chain.parameters()))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("entry", ["matmul/0", "matmul/x", "matmul/"])
def test_a_bad_every_count_is_refused_naming_the_entry(entry: str) -> None:
    with pytest.raises(ValueError, match=r"recompute.exclude_op\[0\]: .*whole number >= 1"):
        resolve_kept([entry])


class _Swapping(torch.nn.Module):
    """A module whose pre-hook swaps its parameter for a derived tensor and whose hook swaps it
    back (as TP's handling of a replicated expert block and a token mixer's local heads do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))
        self.calls = 0  # a record of the forward (public): the recomputation leaves it alone
        self._runs = 0  # the module's own bookkeeping (private): counts the recomputation too
        self.register_forward_pre_hook(self._swap_in)
        self.register_forward_hook(self._swap_back)

    @staticmethod
    def _swap_in(module: torch.nn.Module, _args: object) -> None:
        module.__dict__["stash"] = module._parameters["weight"]
        module._parameters["weight"] = module.__dict__["stash"] * 2  # type: ignore[assignment]

    @staticmethod
    def _swap_back(module: torch.nn.Module, _args: object, _out: object) -> None:
        module._parameters["weight"] = module.__dict__.pop("stash")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self._runs += 1
        return torch.tanh(x @ self.weight) @ self.weight


def test_the_recomputation_reruns_the_module_hooks_to_the_end() -> None:
    from meshforge.memory.recompute import checkpoint_module

    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    plain, wrapped = _Swapping(), _Swapping()
    checkpoint_module(wrapped)
    assert isinstance(wrapped, _Swapping) and [n for n, _ in wrapped.named_parameters()] == ["weight"]
    for module in (plain, wrapped):
        module(x).sum().backward()
    # The hooks ran around the recomputation too: the parameter is a leaf again, with the
    # same gradient; the forward ran twice, and the public record is the forward's.
    assert wrapped.weight.is_leaf and wrapped._runs == 2 and plain._runs == 1
    assert wrapped.calls == plain.calls == 1
    assert torch.equal(wrapped.weight.grad, plain.weight.grad)


def test_recompute_comm_without_tp_is_a_warned_no_op_whose_keys_are_still_checked(tmp_path: Path) -> None:
    from meshforge.config.noops import noop_notes
    from meshforge.memory.comm import apply_comm_recompute
    from meshforge.memory.config import RecomputeCommConfig

    path = tmp_path / "comm.yaml"
    path.write_text(
        BASE_YAML.format(recompute="{}")
        + "recompute_comm: {enable: true, select_module: {attention.qkv: ['0']}}\n"
    )
    notes = dict(noop_notes(load_config(str(path)), "cpu"))
    assert "nothing is all-gathered" in notes["recompute_comm.enable"]
    tp2 = load_config(str(path), ["--parallelism.tensor_parallel=2"])
    assert "recompute_comm.enable" not in dict(noop_notes(tp2, "cpu"))
    model = _tiny_meta_qwen3()
    cfg = RecomputeCommConfig(enable=True, select_module={"attention.qkv": ["0-3"]})
    assert apply_comm_recompute(model, cfg, num_layers=4, tp_mesh=None) == {}
    bad = RecomputeCommConfig(enable=True, select_module={"attention.qvk": ["1"]})
    with pytest.raises(
        ValueError, match=r"recompute_comm.select_module.attention.qvk: .* decoder layer\(s\) 1"
    ):
        apply_comm_recompute(model, bad, num_layers=4, tp_mesh=None)


def _meta_models() -> dict[str, torch.nn.Module]:
    from meshforge.models.deepseek_v3.args import DeepseekV3Args
    from meshforge.models.deepseek_v3.model import build_deepseek_v3
    from meshforge.models.gpt_oss.args import GptOssArgs
    from meshforge.models.gpt_oss.model import build_gpt_oss
    from meshforge.models.qwen3_moe.args import Qwen3MoeArgs
    from meshforge.models.qwen3_moe.model import build_qwen3_moe
    from meshforge.models.qwen3_next.args import Qwen3NextArgs
    from meshforge.models.qwen3_next.model import build_qwen3_next

    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    moe = {"moe_intermediate_size": 16, "num_experts_per_tok": 2, "intermediate_size": 64}
    heads = {"num_key_value_heads": 2, "head_dim": 8}
    return {
        "qwen3": _tiny_meta_qwen3(),
        "qwen3_moe": build_qwen3_moe(Qwen3MoeArgs(**small, **moe, **heads, num_experts=4)),
        "gpt_oss": build_gpt_oss(
            GptOssArgs(**small, **heads, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
        ),
        "deepseek_v3": build_deepseek_v3(
            DeepseekV3Args(
                **small,
                **moe,
                num_key_value_heads=4,
                first_k_dense_replace=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
                n_routed_experts=4,
                n_group=2,
                topk_group=1,
            )
        ),
        "qwen3_next": build_qwen3_next(
            Qwen3NextArgs(
                **small,
                **moe,
                **heads,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                shared_expert_intermediate_size=16,
                num_experts=4,
            )
        ),
    }


# What docs/memory.md's table says each reference word is, per layer of a 2-layer model.
NAMES = {
    "qwen3": {
        "attention.qkv": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]] * 2,
        "experts": [[], []],
    },
    "qwen3_moe": {"experts": [["mlp.experts"]] * 2},
    "gpt_oss": {"attention": [["self_attn"]] * 2, "experts": [["mlp.experts"]] * 2},
    "deepseek_v3": {
        "attention.qkv": [["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"]] * 2,
        "experts": [[], ["mlp.experts"]],
    },
    "qwen3_next": {
        "attention": [["linear_attn"], ["self_attn"]],
        "attention.qkv": [
            ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"],
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ],
        "mlp": [["mlp"], ["mlp"]],
        "experts": [["mlp.experts"]] * 2,
    },
}


def test_reference_words_resolve_to_each_familys_modules() -> None:
    from meshforge.memory.names import decoder_layers, match_submodules

    for family, model in _meta_models().items():
        layers = [layer for _, layer in decoder_layers(model)][:2]
        for word, want in NAMES[family].items():
            got = [[path for path, _ in match_submodules(layer, word, key=word)] for layer in layers]
            assert got == want, (family, word, got)
