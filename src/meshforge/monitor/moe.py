"""`monitor.moe_monitor`: tokens routed to each expert, per monitored layer, every few steps.

Every `save_tokens_per_expert_interval` steps (unset: every log step) the top-k assignment counts
of the step's forwards (all micro-batches) are summed over the data-parallel, context-parallel and
expert-parallel ranks (tensor-parallel ranks repeat the same tokens and count once) and rank 0
writes one line per layer to `{output_dir}/moe/tokens_per_expert.jsonl`:
`{"step": 4, "layer": 0, "counts": [...]}`; each layer's counts sum to tokens x `num_experts_per_tok`.
The step's `metrics.jsonl` record gets `moe_load_ratio/layer<l>` (max / mean count) and their
maximum `moe_max_load_ratio`, which TensorBoard shows too.

`target_layers`: an int N = the MoE layers among decoder layers 0..N-1; a list = those layers
(each must be an MoE layer); unset = every MoE layer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshforge.memory.recompute import recomputing

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from meshforge.monitor.config import MoeMonitorConfig

KEY = "monitor.moe_monitor"


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _moe_layers(model: nn.Module) -> dict[int, nn.Module]:
    """This rank's sparse blocks by global decoder-layer index (a pipeline stage keeps global names).

    A sparse block is the module that records `last_tokens_per_expert` after its forward.
    """
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if match and hasattr(module, "last_tokens_per_expert"):
            found.setdefault(int(match.group(1)), module)
    return found


class MoeMonitor:
    """Counts each monitored layer's expert assignments through forward hooks on due steps."""

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        layers: list[int],
        *,
        num_experts: int,
        interval: int,
        tp: int,
        device: torch.device,
        out_file: Path | None,
    ) -> None:
        self.layers = layers
        self.num_experts = num_experts
        self.interval = interval
        self.tp = tp
        self.device = device
        self.out_file = out_file
        self._active = False
        self._paused = 0
        self._counts: dict[int, torch.Tensor] = {}
        self._hooks: list[RemovableHandle] = [
            block.register_forward_hook(self._hook_for(layer))
            for layer, block in blocks.items()
            if layer in layers
        ]
        if out_file is not None:
            out_file.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def build(
        cls,
        cfg: MoeMonitorConfig,
        model: nn.Module,
        *,
        log_interval: int,
        world: int,
        tp: int,
        device: torch.device,
        output_dir: Path | None,
        resume_step: int = 0,
    ) -> MoeMonitor | None:
        """None when the monitor is off. Collective (one object gather). `output_dir`: rank 0's only.

        Raises ValueError naming the key when the model has no MoE layer or a listed layer is not one.
        """
        if not cfg.is_set():
            return None
        blocks = _moe_layers(model)
        experts = int(getattr(model, "num_routed_experts", 0) or 0) if blocks else 0
        local = sorted(blocks)
        every = [local]
        if dist.is_initialized() and world > 1:
            gathered: list[tuple[list[int], int] | None] = [None] * world
            dist.all_gather_object(gathered, (local, experts))
            every = [g[0] for g in gathered if g is not None]
            experts = max(int(g[1]) for g in gathered if g is not None)
        moe = sorted({i for layers in every for i in layers})
        if not moe or experts <= 0:
            raise ValueError(f"{KEY}: the model has no MoE layer to monitor")
        target = cfg.target_layers
        if target is None:
            layers = moe
        elif isinstance(target, int):
            layers = [i for i in moe if i < target]
            if not layers:
                raise ValueError(
                    f"{KEY}.target_layers: {target}: none of the first {target} layers is an MoE layer (MoE layers: {moe})"
                )
        else:
            wrong = [i for i in target if i not in moe]
            if wrong:
                raise ValueError(
                    f"{KEY}.target_layers: {wrong} are not MoE layers of this model (MoE layers: {moe})"
                )
            layers = sorted(set(target))
        out_file = None
        if output_dir is not None:
            out_file = output_dir / "moe" / "tokens_per_expert.jsonl"
            _truncate(out_file, resume_step)
        return cls(
            blocks,
            layers,
            num_experts=experts,
            interval=cfg.save_tokens_per_expert_interval or log_interval,
            tp=tp,
            device=device,
            out_file=out_file,
        )

    def ignore_inside(self, owner: object, method: str) -> None:
        """Count nothing while `owner.method` runs (a forward that is not a training forward).

        torch's pipeline stages run their module once on the first step to learn the shapes
        they exchange (`PipelineStage._forward_metadata_inference`): real routing on a first
        stage, routing of uninitialised inputs on the others, neither of them a micro-batch.
        """
        original = getattr(owner, method, None)
        if original is None:
            return

        def paused(*args: Any, **kwargs: Any) -> Any:
            self._paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._paused -= 1

        setattr(owner, method, paused)

    def _hook_for(self, layer: int) -> Any:
        def hook(module: nn.Module, _args: object, _output: object) -> None:
            counts = getattr(module, "last_tokens_per_expert", None)
            # A checkpoint's recomputation runs the block's hooks again: its routing is counted once.
            if not self._active or self._paused or counts is None or recomputing():
                return
            counts = counts.detach().to(torch.int64)
            previous = self._counts.get(layer)
            self._counts[layer] = counts if previous is None else previous + counts

        return hook

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def begin(self, step: int) -> None:
        """Start counting if `step` (1-based, the one about to run) is a monitored step."""
        self._active = self.due(step)
        self._counts = {}

    def end(self, step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Reduce a monitored step's counts (collective on due steps); metrics and file lines."""
        if not self._active:
            return {}, []
        self._active = False
        table = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64)
        for row, layer in enumerate(self.layers):
            counts = self._counts.get(layer)
            if counts is not None:
                table[row] = counts.cpu()
        table = table.to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.SUM)
        table = table.cpu() // self.tp
        lines: list[dict[str, Any]] = []
        record: dict[str, float] = {}
        for row, layer in enumerate(self.layers):
            counts = table[row]
            lines.append({"step": step, "layer": layer, "counts": counts.tolist()})
            mean = float(counts.double().mean())
            record[f"moe_load_ratio/layer{layer}"] = float(counts.max()) / mean if mean > 0 else 0.0
        if record:
            record["moe_max_load_ratio"] = max(record.values())
        if self.out_file is not None:
            with self.out_file.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        return record, lines

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _truncate(path: Path, resume_step: int) -> None:
    """Keep the lines up to the resumed step (all of a fresh run's file is dropped)."""
    kept: list[str] = []
    if resume_step and path.exists():
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= resume_step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in kept))
