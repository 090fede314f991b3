"""`checkpoint:` section: what to save, where, how often, and what to load at start (light).

Defaults follow the MindFormers code; `save_epochs` and `save_hf_weights` give the
MindSpeed-LLM keys of the same name a native home.
"""

from __future__ import annotations

from typing import Literal

from meshforge.config.base import AtLeastOne, Bool, Int, StrictSection, describe


class CheckpointConfig(StrictSection):
    """Saving and loading of DCP checkpoints."""

    enable_save: Bool = describe(True, "Save checkpoints during and at the end of training.")
    save_path: str = describe("", "Folder for checkpoints; empty means `{training.output_dir}/checkpoints`.")
    save_max: AtLeastOne | None = describe(
        5, "Keep at most this many complete checkpoints (oldest pruned); null keeps all."
    )
    save_interleaved_steps: AtLeastOne | None = describe(
        1000, "Save every this many optimizer steps; null: no interval saves (the final step is still saved)."
    )
    no_save_optim: Bool = describe(
        False, "Save model weights only, without optimizer state (no exact resume)."
    )
    async_save: Bool = describe(False, "Save asynchronously so training continues while writing.")
    prefix: str = describe("checkpoint", "Name prefix of each step folder: `{prefix}-{step:08d}`.")
    remove_redundancy: Bool = describe(False, "Drop replicated data across ranks when saving.")
    load_path: str = describe(
        "",
        "Checkpoint to start from: a run folder (latest complete step) or a step folder; `auto`: the "
        "latest complete step of this run's own checkpoint folder, if any; empty = none.",
    )
    load_balanced: Bool = describe(False, "Balance checkpoint loading across ranks.")
    no_load_optim: Bool = describe(False, "Load model weights only, not optimizer/scheduler state.")
    load_worker_number: AtLeastOne = describe(1, "Number of threads used to read a checkpoint.")
    save_global_layout_cache: Bool = describe(
        True,
        "Cache DCP's global save plan after the first save, so later saves of the run skip re-planning.",
    )
    reshard_worker_num: AtLeastOne = describe(1, "Number of workers used when resharding on load.")
    save_epochs: Int | None = describe(
        None, "Also save at every this many epoch boundaries (MindSpeed `save_epochs`)."
    )
    on_save_error: Literal["stop", "continue"] = describe(
        "stop",
        "After a save that cannot be written (full or read-only disk): stop the run (naming the last "
        "complete checkpoint), or continue training and try again at the next save.",
    )
    save_hf_weights: Bool = describe(
        False, "Export Hugging Face safetensors at the end of training (MindSpeed `save_hf_weights`)."
    )
    export_dir: str | None = describe(
        None,
        "Folder of the end-of-run exports: a LoRA run's PEFT adapter files, a full run's Hugging Face "
        "weights (save_hf_weights); null = {output_dir}/adapter and {output_dir}/hf. LLaMA-Factory's "
        "layout is the run folder itself (its output_dir).",
    )
