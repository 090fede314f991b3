"""MindSpeed-LLM's DPO flags (`posttrain_gpt.py --stage dpo`) in the Megatron importer (torch-free).

MindSpeed-LLM trains DPO from a launch script with `--stage dpo` and its `dpo` argument group:
`--dpo-beta`, `--dpo-loss-type` (sigmoid, hinge, ipo), `--dpo-label-smoothing`, `--pref-ftx` and
`--ref-model`, LLaMA-Factory's loss under Megatron's names; they map to `training.stage`,
`pref_beta`, `pref_loss`, `dpo_label_smoothing` and `pref_ftx` (docs/preference.md). The
reference model is the policy's source in meshforge (`model.model_name_or_path`, LoRA: the
adapters off), so `--ref-model` is read only when it names that folder, and refused otherwise. The
pairwise data is refused by `megatron_table` (`--is-pairwise-dataset`: MindSpeed's preprocessed
pair datasets); the MindSpeed-LLM flag list this importer knows has no SimPO flags.
"""

from __future__ import annotations

from pathlib import Path

from meshforge.config.megatron_values import Flags, Native

DPO_LOSSES = ("sigmoid", "hinge", "ipo")
# flag -> training key; each is read only with --stage dpo.
_DPO_FLOATS = {
    "--dpo-beta": "pref_beta",
    "--dpo-label-smoothing": "dpo_label_smoothing",
    "--pref-ftx": "pref_ftx",
}


def preference_flags(flags: Flags, native: Native) -> None:
    """`--stage dpo` and its flags; another stage, or a dpo flag without it, is refused by name."""
    stage = flags.text("--stage")
    dpo_flags = [*_DPO_FLOATS, "--dpo-loss-type", "--ref-model"]
    if stage != "dpo":
        if stage is not None:
            flags.refuse(
                "--stage",
                f"not supported yet: --stage {stage} (MindSpeed-LLM's posttrain stages other than dpo; "
                "sft reads its preprocessed instruction data)",
            )
        for flag in dpo_flags:
            if flag in flags:
                flags.text(flag)
                flags.refuse(flag, "read only with --stage dpo")
        return
    native.to("training.stage", "dpo", "--stage", "preference pairs, docs/preference.md")
    for flag, key in _DPO_FLOATS.items():
        value = flags.float(flag)
        if value is not None:
            native.to(f"training.{key}", value, flag)
    loss = flags.text("--dpo-loss-type")
    if loss is not None:
        if loss in DPO_LOSSES:
            native.to("training.pref_loss", loss, "--dpo-loss-type")
        else:
            flags.refuse("--dpo-loss-type", f"{loss!r} is not one of {', '.join(DPO_LOSSES)}")
    reference = flags.text("--ref-model")
    if reference is None:
        return
    policy = native.get("model.model_name_or_path")
    if policy is not None and Path(reference).resolve() == Path(str(policy)).resolve():
        native.say(
            f"--ref-model {reference} -> the reference model is the policy's source (model.model_name_or_path; "
            "a frozen copy, or with LoRA the adapters disabled)"
        )
        return
    flags.refuse(
        "--ref-model",
        f"not supported yet: a reference model other than the policy's source ({reference} is not "
        f"--load's Hugging Face folder {policy or '(none given)'}): the reference is built from "
        "model.model_name_or_path",
    )
