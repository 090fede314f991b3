"""Pipeline split: layer assignment ('auto', explicit uneven, interleaved, V), errors, pruned names."""

from __future__ import annotations

import pytest
import torch

from meshforge.models.qwen3.args import Qwen3Args
from meshforge.models.qwen3.model import Qwen3ForCausalLM, build_qwen3
from meshforge.parallel.pipeline import (
    StageModule,
    assign_layers,
    canonical_schedule,
    check_microbatches,
    split_model,
)

ARGS = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def _layers(stages) -> list[tuple[int, ...]]:
    return [s.layers for s in stages]


def test_auto_even_and_uneven() -> None:
    stages = assign_layers(8, pp_size=2)
    assert _layers(stages) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [s.rank for s in stages] == [0, 1]
    assert stages[0].is_first and not stages[0].is_last and stages[1].is_last
    # 7 layers on 4 stages: the middle stages take the extra layers first, the head stage last.
    assert [len(s.layers) for s in assign_layers(7, pp_size=4)] == [2, 2, 2, 1]
    assert [len(s.layers) for s in assign_layers(6, pp_size=4)] == [1, 2, 2, 1]
    # Interleaved: stage s on rank s % pp.
    stages = assign_layers(8, pp_size=2, interleave=2)
    assert _layers(stages) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.rank for s in stages] == [0, 1, 0, 1]


def test_explicit_strings_and_index_lists() -> None:
    # One string per rank, its chunks in order: chunk c of rank r is virtual stage c * pp + r.
    stages = assign_layers(5, pp_size=2, layers_per_stage=["0,3", "1-2,4"], interleave=2)
    assert _layers(stages) == [(0,), (1, 2), (3,), (4,)]
    assert [s.rank for s in stages] == [0, 1, 0, 1]
    same = assign_layers(5, pp_size=2, layers_per_stage=[[0, 3], [1, 2, 4]], interleave=2)
    assert same == stages
    uneven = assign_layers(4, pp_size=2, layers_per_stage=["0", "1-3"])
    assert _layers(uneven) == [(0,), (1, 2, 3)]
    assert assign_layers(4, pp_size=2, layers_per_stage=[[0, 1, 2], [3]])[0].layers == (0, 1, 2)
    # V placement (zbv): rank r holds stages r and 2 * pp - 1 - r.
    v = assign_layers(4, pp_size=2, layers_per_stage=["0,3", "1,2"], interleave=2, placement="v")
    assert _layers(v) == [(0,), (1,), (2,), (3,)]
    assert [s.rank for s in v] == [0, 1, 1, 0]


@pytest.mark.parametrize(
    ("spec", "interleave", "message"),
    [
        (["0-1"], 1, "one entry per pipeline rank"),
        (["0-1", "3"], 1, r"stage 1 \(rank 1\) starts at layer 3, expected 2"),
        (["0-1", "2"], 1, "cover layers 0..2; the model has 4"),
        (["0-2", "2-3"], 1, "starts at layer 2, expected 3"),
        (["0-1", "2-3"], 2, r"\[0\]: has 1 chunk\(s\) \(0-1\); needs pipeline_parallel_interleave_num = 2"),
        (["0-x", "2-3"], 1, r"\[0\]: invalid layer spec"),
        ([[0, 2], [1, 3]], 1, r"\[0\]: has 2 chunk\(s\)"),
        ([[1, 0], [2, 3]], 1, "ascending, distinct"),
        ([[0, 1], [1, 2, 3]], 1, "starts at layer 1, expected 2"),
        ("even", 1, "a string must be 'auto'"),
        ([{"a": 1}, "2-3"], 1, "write the rank's chunks"),
    ],
)
def test_bad_specs_name_the_key(spec, interleave: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        assign_layers(4, pp_size=2, layers_per_stage=spec, interleave=interleave)
    assert "parallelism.pipeline_parallel_layers_per_stage" in str(info.value)


def test_auto_needs_a_layer_per_stage() -> None:
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_layers_per_stage: 'auto' needs at least one layer"
    ):
        assign_layers(3, pp_size=2, interleave=2)


def test_schedule_names_and_microbatch_rules() -> None:
    assert canonical_schedule("Interleaved1F1B") == "interleaved1f1b"
    assert canonical_schedule("interleaved") == "interleaved1f1b"
    assert canonical_schedule("GPipe") == "gpipe"
    assert canonical_schedule("zero_bubble") == "interleavedzerobubble"
    with pytest.raises(ValueError, match="parallelism.pipeline_parallel_schedule: unknown schedule 'looped'"):
        canonical_schedule("looped")
    check_microbatches("gpipe", 1, 2)
    check_microbatches("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"training.global_batch_size / training.local_batch_size: 1 micro"):
        check_microbatches("1f1b", 1, 2)
    check_microbatches("interleaved", 6, 2)
    with pytest.raises(
        ValueError, match=r"needs a count divisible by max\(1, micro-batches // pipeline_parallel\) = 2"
    ):
        check_microbatches("interleaved", 5, 2)


def _meta(tie: bool = False) -> Qwen3ForCausalLM:
    return build_qwen3(Qwen3Args(**ARGS, tie_word_embeddings=tie), device="meta")


@pytest.mark.parametrize("tie", [False, True])
def test_pruned_names_are_the_originals(tie: bool) -> None:
    # remove_duplicate=False: a tied model has both names, as its state dict does.
    full = dict(_meta(tie).named_parameters(remove_duplicate=False))
    seen: dict[str, torch.Size] = {}
    for rank in range(2):
        split = split_model(
            _meta(tie),
            pp_rank=rank,
            pp_size=2,
            layers_per_stage=["0,3", "1-2,4-5"],
            interleave=2,
            schedule="interleaved",
        )
        names = dict(split.model.named_parameters())
        assert set(names) <= set(full)
        assert not set(names) & set(seen)
        seen.update({n: p.shape for n, p in names.items()})
        assert [s.index for s in split.stages] == [rank, rank + 2]
        if rank == 0:
            assert list(split.model.model.layers) == ["0", "3"]
            assert split.model.model.embed_tokens is not None and split.model.lm_head is None
            assert split.model.model.norm is None
            assert split.has_first and not split.has_last and split.tied_copies == ()
        else:
            assert list(split.model.model.layers) == ["1", "2", "4", "5"]
            assert split.model.model.embed_tokens is None and split.model.lm_head is not None
            assert "lm_head.weight" in names  # its own parameter when tied
            assert split.tied_copies == (("lm_head.weight",) if tie else ())
        assert split.tied_across_ranks == tie
    # Every original name lives on exactly one rank (the tied head's on the last).
    assert set(seen) == set(full)
    assert all(seen[n] == full[n].shape for n in full)


def _decoder_stage_families() -> list[str]:
    """The families whose stages run the shared ``DecoderModel`` stage preparation."""
    from meshforge.models.common.family_parts import decoder_stage
    from meshforge.models.registry import SPECS

    return [spec.name for spec in SPECS if spec.stage_preparation is decoder_stage]


# Per family: the options of a six-layer model (tied head where the family allows it); a family
# that takes the shared stage preparation fails the key check until it has its entry.
STAGE_OPTIONS: dict[str, dict[str, object]] = {
    "qwen3": {"tie_word_embeddings": True},
    "llama": {"tie_word_embeddings": True},
    "qwen3_moe": {},
    "deepseek_v3": {},
    "minimax_m2": {},
}


def test_every_decoder_stage_family_has_options() -> None:
    assert set(STAGE_OPTIONS) == set(_decoder_stage_families())


def _family_builder(family: str):
    from meshforge.models.registry import resolve_family

    spec = resolve_family(model_type=family)
    options = {"flavor": "tiny", "vocab_size": 64, "num_hidden_layers": 6, **STAGE_OPTIONS[family]}
    return lambda: spec.build(options, device="cpu")


@pytest.mark.parametrize("family", _decoder_stage_families())
def test_stage_forward_equals_the_whole_model(family: str) -> None:
    torch.manual_seed(0)
    build = _family_builder(family)
    ref = build()
    ids = torch.randint(0, 64, (2, 10))
    seg = torch.tensor([[1] * 4 + [2] * 6, [1] * 10])
    want = ref(ids, segment_ids=seg)
    h = ids
    for index, rank in enumerate([0, 1, 0, 1]):
        model = build()
        split = split_model(
            model,
            pp_rank=rank,
            pp_size=2,
            layers_per_stage=[[0, 1, 4], [2, 3, 5]],
            interleave=2,
            schedule="interleaved",
        )
        (stage,) = [s for s in split.stages if s.index == index]
        module = StageModule(split.model, stage)
        own = {id(p) for p in module.parameters()}
        assert own <= {id(p) for p in split.model.parameters()}
        h = module(h, segment_ids=seg)
        if hasattr(ref, "moe_layers"):
            # MoE helpers see this rank's layers under their global indices.
            hosted = [int(k) for k in split.model.model.layers]
            assert set(split.model.moe_layers()) == {i for i in ref.moe_layers() if i in hosted}
    # The builders draw the same weights every time; the last rank's head is the embedding copy.
    torch.testing.assert_close(h, want, rtol=1e-6, atol=1e-6)


def test_unsupported_families_and_options() -> None:
    from meshforge.models.registry import build_model  # noqa: F401  (registry import is cheap)

    class Other(torch.nn.Module):
        family = "gpt_oss"

    with pytest.raises(
        NotImplementedError, match="not supported yet: parallelism.pipeline_parallel > 1 for gpt_oss"
    ):
        split_model(Other(), pp_rank=0, pp_size=2)
    with pytest.raises(
        ValueError, match="pipeline_parallel_interleave_num: 2 stages per rank need an interleaved"
    ):
        split_model(_meta(), pp_rank=0, pp_size=2, interleave=2, schedule="1f1b")
    with pytest.raises(ValueError, match="zbv schedule runs exactly 2 stages"):
        split_model(_meta(), pp_rank=0, pp_size=2, interleave=1, schedule="zbv")


def test_pruned_model_materialises_and_counts() -> None:
    # to_empty calls tie_weights after _apply: it must not re-tie (or crash) where one end is gone.
    for rank in range(2):
        split = split_model(_meta(tie=True), pp_rank=rank, pp_size=2, layers_per_stage=["0-2", "3-5"])
        split.model.to_empty(device="cpu")
        params = dict(split.model.named_parameters())
        assert all(p.device.type == "cpu" for p in params.values())
        assert split.model.num_params() == sum(p.numel() for p in params.values())
        assert split.model.num_params(exclude_embedding=True) <= split.model.num_params()
        assert split.stage_ids == [rank] and split.tied_copies == (("lm_head.weight",) if rank else ())
