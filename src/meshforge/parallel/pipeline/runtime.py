"""The pipeline at run time: one ``PipelineStage`` per local stage, the schedule, its step and evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from meshforge.loss.cross_entropy import count_valid_tokens
from meshforge.loss.lm import LMLoss
from meshforge.parallel.pipeline.layout import (
    SCHEDULE_KEY,
    SCHEDULES,
    ZERO_BUBBLE,
    PipelineSplit,
    canonical_schedule,
)
from meshforge.parallel.pipeline.stage import (
    StageModule,
    _PipelinedCausalLM,
    router_aux_experts,
)
from meshforge.utils.distributed import local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.schedules import _Action, _PipelineSchedule

# Action types a forward-only pass keeps: the forwards, their transfers, FSDP's (un)shards.
_FORWARD_ACTIONS = ("FORWARD", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")


@contextmanager
def _forward_only(schedule: _PipelineSchedule, enabled: bool) -> Iterator[None]:
    """Run ``schedule`` (a torch runtime schedule) with its backward actions left out, inside the block.

    Why zbv needs it: in eval mode torch's runtime skips the backward computations but still hands
    the input gradient of a V-schedule stage to the previous stage when both sit on the same rank
    (stages ``pp`` and ``pp - 1`` on the last pp rank), and asks a stage without backward for it
    (``get_local_bwd_output``: an AssertionError). Without the backward actions the order is each
    rank's forwards in the schedule's own order, with their sends and receives: every forward's
    input comes from a forward the schedule already ran before it, and dropping actions only
    removes waits, so the order cannot deadlock. The full order (same schedule object, so the
    stages' eval/train re-initialisation stays torch's own) is put back on exit. It edits the
    runtime's lowered order, ``pipeline_order_with_comms`` (what its ``_step_microbatches`` runs).
    """
    if not enabled:
        yield
        return
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    assert isinstance(schedule, _PipelineScheduleRuntime), "zbv runs on torch's runtime schedule"
    full = schedule.pipeline_order_with_comms
    forward_only: dict[int, list[_Action]] = {}
    for rank, actions in full.items():
        kept: list[_Action] = []
        for action in actions:
            subs = getattr(action, "sub_actions", None) or (action,)  # an overlapped F/B pair: its F
            kept.extend(a for a in subs if a.computation_type.name in _FORWARD_ACTIONS)
        forward_only[rank] = kept
    schedule.pipeline_order_with_comms = forward_only
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full


class StageLoss(Protocol):
    """What the last stage computes in place of the LM loss (`Pipeline.stage_loss`), e.g. a pair loss.

    `target` is the last stage's target of the step's micro-batches, concatenated by rows (the
    schedule splits it as it splits the labels). `__call__` gets one micro-batch's output (logits,
    or normed hidden states with `head`, the head's weight), its target, the step's normalizer and
    the micro-batch's router aux loss (None without one) and returns the objective to
    backpropagate and the detached loss sum to report. `begin` and `end` run around every
    schedule call (`train` False: an evaluation); `units` is what an evaluation counts per
    micro-batch (a filler micro-batch without labels must count, and add, nothing) and `shard`
    turns a whole evaluation batch into this rank's micro-batch (its slice under CP).
    """

    def target(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor: ...

    def __call__(
        self,
        output: torch.Tensor,
        target: torch.Tensor,
        normalizer: torch.Tensor,
        aux: torch.Tensor | None,
        head: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def begin(self, pipeline: Pipeline, micro: list[dict[str, torch.Tensor]], *, train: bool) -> None: ...

    def end(self, pipeline: Pipeline, *, train: bool) -> None: ...

    def units(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def _describe(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    from torch.distributed.tensor import DTensor

    placements = str(tuple(t.placements)) if isinstance(t, DTensor) else "plain"
    return tuple(local_tensor(t).shape), placements


def check_microbatches(schedule: str, n_microbatches: int, pp_size: int) -> None:
    """Raise a config-level error when ``schedule`` cannot run ``n_microbatches`` micro-batches.

    Raises:
        ValueError: naming ``training.global_batch_size`` / ``training.local_batch_size``.
    """
    name = canonical_schedule(schedule)
    need = None
    if n_microbatches < 1:
        need = "at least 1"
    elif name == "1f1b" and n_microbatches < pp_size:
        need = f"at least pipeline_parallel = {pp_size}"
    elif name in ("interleaved1f1b", "interleavedzerobubble"):
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            need = (
                f"a count divisible by max(1, micro-batches // pipeline_parallel) = {rounds} "
                "(e.g. a multiple of pipeline_parallel)"
            )
    if need:
        raise ValueError(
            f"training.global_batch_size / training.local_batch_size: {n_microbatches} micro-batches per step "
            f"(global_batch_size / (local_batch_size x data-parallel ranks)); the {name} schedule with "
            f"pipeline_parallel = {pp_size} needs {need}"
        )


class Pipeline:
    """The stages and schedule of this rank; ``step`` runs one optimizer step's micro-batches.

    Built by ``build_pipeline``.
    """

    def __init__(
        self,
        split: PipelineSplit,
        model: nn.Module,
        pp_group: dist.ProcessGroup,
        *,
        device: torch.device,
        n_microbatches: int,
        schedule_name: str,
        aux_coef: float = 0.0,
        lm_loss: LMLoss | None = None,
        mtp_coef: float = 0.0,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.split = split
        self.model = model
        self.group = pp_group
        self.device = torch.device(device)
        self.schedule_name = schedule_name
        self.aux_coef = float(aux_coef)
        self.aux_experts = router_aux_experts(model) if self.aux_coef != 0.0 else None
        # split_model put _PipelinedCausalLM in front of the model's class.
        pipelined = cast(_PipelinedCausalLM, model)
        # Every stage forward then returns (hidden, carry); see the module docstring.
        pipelined._pp_aux_experts = self.aux_experts
        self.lm_loss = lm_loss if lm_loss is not None else LMLoss()
        pipelined._pp_return_hidden = self.lm_loss.needs_hidden
        self._aux: list[torch.Tensor] = []
        self.aux_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        # MTP (split.mtp_layers > 0, mtp_coef > 0): the last stage returns (logits, *mtp_logits)
        # and the target carries each depth's labels; mtp_sum is the logged sum (as aux_sum).
        self.mtp_coef = float(mtp_coef) if split.mtp_layers else 0.0
        self._mtp_run = False
        self._mtp: list[torch.Tensor] = []
        self.mtp_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.stages = [
            PipelineStage(StageModule(model, s), s.index, split.num_stages, self.device, group=pp_group)
            for s in split.stages
        ]
        self._schedules: dict[int, _PipelineSchedule] = {}
        self._global_tokens: torch.Tensor | None = None
        self._ce: list[torch.Tensor] = []
        self._shape: tuple[int, ...] | None = None
        self.schedule = self._schedule_for(n_microbatches)
        # Set after the build (`train/preference_pipeline.py`): the last stage's loss instead of the LM loss.
        self.stage_loss: StageLoss | None = None
        # An evaluation batch as training hands one to `step` (CP: this rank's slice); None: as is.
        self.eval_shard: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def _ce_sum(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed CE of the last stage's output: logits, or normed hidden states (chunked/fused loss)."""
        if not self.lm_loss.needs_hidden:
            return self.lm_loss(output, labels)
        # Read after the forward: under FSDP the head is unsharded by then.
        return self.lm_loss(output, labels, self.model.get_parameter("lm_head.weight"))

    def _loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        global_tokens = self._global_tokens
        assert global_tokens is not None, "_run sets the step's token count before the schedule runs"
        if self.stage_loss is not None:
            main, carry = output if self.aux_experts is not None else (output, None)
            aux = self._aux_from_carry(carry) if carry is not None else None
            head = self.model.get_parameter("lm_head.weight") if self.lm_loss.needs_hidden else None
            objective, loss_sum = self.stage_loss(main, labels, global_tokens, aux, head)
            self._ce.append(loss_sum)
            return objective
        if self._mtp_run:
            # labels: [B, 1 + depths, S], the main targets then each depth's (loss.mtp_labels).
            logits, *depths = output
            ce = self._ce_sum(logits, labels[:, 0])
            self._ce.append(ce.detach())
            mtp = torch.stack(
                [self._ce_sum(out, labels[:, k]) for k, out in enumerate(depths, start=1)]
            ).mean()
            self._mtp.append((mtp.detach() / global_tokens).float())
            return ce / global_tokens + self.mtp_coef * mtp / global_tokens
        if self.aux_experts is None:
            ce = self._ce_sum(output, labels)
            self._ce.append(ce.detach())
            return ce / global_tokens
        logits, carry = output
        ce = self._ce_sum(logits, labels)
        self._ce.append(ce.detach())
        aux = self._aux_from_carry(carry)
        # As Trainer.forward_backward: the micro-batch's aux loss weighted by its share of the
        # global valid tokens (on a CP rank: its own part of them; the shares add up).
        weight = count_valid_tokens(labels).to(torch.float32) / global_tokens
        self._aux.append((aux.detach() * weight).float())
        return ce / global_tokens + self.aux_coef * aux * weight

    def _aux_from_carry(self, carry: torch.Tensor) -> torch.Tensor:
        """The Switch aux loss of one micro-batch from the totals carried through the stages."""
        from meshforge.models.common.moe import reduce_router_totals, switch_loss

        e = int(self.aux_experts)  # type: ignore[arg-type]
        # Only the probability sums carry gradient; the counts' gradient would be meaningless.
        prob_sum, assignments, rows = carry[:e], carry[e : 2 * e].detach(), carry[2 * e].detach()
        group = getattr(self.model, "aux_reduce_group", None)  # the CP group, when CP splits rows
        assignments, prob_sum, rows = reduce_router_totals(assignments, prob_sum, rows, group)
        return switch_loss(assignments, prob_sum, rows, e)

    def _schedule_for(self, n_microbatches: int) -> _PipelineSchedule:
        if n_microbatches not in self._schedules:
            import torch.distributed.pipelining.schedules as schedules

            check_microbatches(self.schedule_name, n_microbatches, self.split.pp_size)
            cls_name, stages_per_rank, _ = SCHEDULES[self.schedule_name]
            cls = getattr(schedules, cls_name)
            stages = self.stages[0] if stages_per_rank == "one" else self.stages
            # scale_grads=False: the loss is already divided by the global token count.
            try:
                self._schedules[n_microbatches] = cls(
                    stages, n_microbatches, loss_fn=self._loss, scale_grads=False
                )
            except ValueError as exc:
                raise ValueError(
                    f"training.global_batch_size / training.local_batch_size: {n_microbatches} micro-batches "
                    f"per step do not fit the {self.schedule_name} schedule: {exc}"
                ) from None
        return self._schedules[n_microbatches]

    def step(self, micro: list[dict[str, torch.Tensor]], global_tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch through the pipeline.

        Args:
            micro: One dict per micro-batch with ``input_ids`` and ``labels`` ``[B, S]`` (labels
                already shifted, -100 ignored) and optionally ``position_ids``, ``segment_ids``.
            global_tokens: Valid label tokens of the whole global batch (all micro-batches, all
                data-parallel ranks); each micro-batch's loss is its CE sum divided by it.

        Returns:
            The CE sum of this rank's micro-batches (float32, detached, 0-dim), the same on
            every pp rank. Gradients are accumulated into ``.grad`` (tied embedding/head
            gradients already summed across the pp ranks holding them). With the router aux
            loss on, ``self.aux_sum`` then holds the sum over the micro-batches of each one's
            aux loss times its token weight (what ``Trainer.forward_backward`` adds to its
            ``_aux_sum``), the same on every pp rank.
        """
        if self.stage_loss is not None:
            self.stage_loss.begin(self, micro, train=True)
        total = self._run(micro, global_tokens, train=True)
        self._sum_tied_grads()
        if self.stage_loss is not None:
            self.stage_loss.end(self, train=True)
        return total

    def _run(
        self, micro: list[dict[str, torch.Tensor]], global_tokens: torch.Tensor, *, train: bool
    ) -> torch.Tensor:
        if not micro:
            raise ValueError("Pipeline.step: no micro-batches")
        # Other keys are ignored, as the single-stage forward ignores them.
        keys = [k for k in ("input_ids", "labels", "position_ids", "segment_ids") if k in micro[0]]
        for i, mb in enumerate(micro):
            if [k for k in ("input_ids", "labels", "position_ids", "segment_ids") if k in mb] != keys:
                raise ValueError(
                    f"Pipeline.step: micro-batch {i} has keys {sorted(mb)}, micro-batch 0 {keys}"
                )
        shape = tuple(micro[0]["input_ids"].shape)
        if any(tuple(mb["input_ids"].shape) != shape for mb in micro) or self._shape not in (None, shape):
            got = sorted({tuple(mb["input_ids"].shape) for mb in micro})
            raise ValueError(
                f"Pipeline: micro-batches of shape {got} after {self._shape or shape}: the stages' "
                "transfer buffers are sized by the first micro-batch, so every micro-batch needs the same "
                "[local_batch_size, sequence length] (pad to a fixed length, e.g. train_dataset.cutoff_len)"
            )
        self._shape = shape
        schedule = self._schedule_for(len(micro))
        batch = {k: torch.cat([mb[k] for mb in micro]).to(self.device) for k in keys}
        kwargs: dict[str, Any] = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
        kwargs["seq_len"] = int(batch["input_ids"].shape[-1])  # not a tensor: every micro-batch gets it
        args = (batch["input_ids"],) if self.split.has_first else ()
        target = None
        if self.split.has_last:
            target = (
                batch["labels"] if self.stage_loss is None else self.stage_loss.target(micro).to(self.device)
            )
        self._mtp_run = train and self.mtp_coef > 0
        if self._mtp_run:
            from meshforge.loss.cross_entropy import mtp_labels

            kwargs["mtp_ids"] = batch["input_ids"]
            if target is not None:
                seg = batch.get("segment_ids")
                depths = range(1, self.split.mtp_layers + 1)
                target = torch.stack([target, *(mtp_labels(target, k, seg) for k in depths)], dim=1)
        self._global_tokens = global_tokens.to(self.device)
        self._ce = []
        self._aux = []
        self._mtp = []
        if train:
            self._set_fsdp_sync(False)
            try:
                schedule.step(*args, target=target, return_outputs=False, **kwargs)
            finally:
                self._set_fsdp_sync(True)
            self._fsdp_reduce_grads()
        else:
            # eval() forwards its keyword arguments to step(), return_outputs included.
            with _forward_only(schedule, self.schedule_name == "zbv"):
                schedule.eval(*args, target=target, return_outputs=False, **kwargs)
        # The first run in a mode also calls the loss once for shape inference: keep the real calls.
        ce = self._ce[-len(micro) :] if self.split.has_last else []
        total = torch.stack(ce).sum() if ce else torch.zeros((), dtype=torch.float32, device=self.device)
        total = total.float()
        if self.aux_experts is not None:
            # Only the last stage's rank computed the aux values; one all-reduce for both sums.
            aux = self._aux[-len(micro) :] if self.split.has_last else []
            aux_total = torch.stack(aux).sum() if aux else torch.zeros((), device=self.device)
            both = torch.stack([total, aux_total.float()])
            dist.all_reduce(both, group=self.group)
            total = both[0]
            if train:  # evaluation leaves the training step's value alone
                self.aux_sum = both[1]
        elif self._mtp_run:
            mtp = self._mtp[-len(micro) :] if self.split.has_last else []
            both = torch.stack(
                [total, torch.stack(mtp).sum() if mtp else torch.zeros((), device=self.device)]
            )
            dist.all_reduce(both, group=self.group)
            total, self.mtp_sum = both[0], both[1]
        else:
            dist.all_reduce(total, group=self.group)
        self._ce = []
        self._aux = []
        self._mtp = []
        return total

    def _set_fsdp_sync(self, sync: bool) -> None:
        """Gradient sync of an FSDP-wrapped model on (each backward reduces) or off (accumulate).

        The stages call the FSDP root through ``StageModule``, which is no ``FSDPModule``, so
        the schedule's own FSDP handling does not apply; this does what it would do (reduce
        once per step, after the last micro-batch).
        """
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)
            self.model.set_reshard_after_backward(sync)
            self.model.set_is_last_backward(sync)

    def _fsdp_reduce_grads(self) -> None:
        """Reduce-scatter the gradients accumulated over the step's micro-batches (FSDP only)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.model, FSDPModule):
            return
        # torch's @contract decorator attaches `state`, which fully_shard's typed overloads hide.
        state = fully_shard.state(self.model)  # type: ignore[attr-defined]
        for module_state in state._state_ctx.all_states:
            for group in module_state._fsdp_param_groups:
                group.post_backward()
        # Waits for the reductions and reshards, as at the end of an ordinary backward.
        state._root_post_backward_final_callback()

    @torch.no_grad()
    def evaluate(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward only: the CE sum of ``micro`` (float32, 0-dim), the same on every pp rank.

        Every schedule runs its own action order with the backward actions idle; zbv runs its
        forward actions only (see :func:`_forward_only`).

        Args:
            micro: Micro-batches as for ``step``.
        """
        if self.stage_loss is not None:
            self.stage_loss.begin(self, micro, train=False)
        total = self.forward_only(micro)
        if self.stage_loss is not None:
            self.stage_loss.end(self, train=False)
        return total

    @torch.no_grad()
    def forward_only(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """``evaluate`` without the stage loss' ``begin``/``end`` (e.g. a reference model's forward)."""
        return self._run(micro, torch.ones((), device=self.device), train=False)

    def _tied_pair(self) -> tuple[nn.Parameter | None, int]:
        """This rank's end of a tied pair split across ranks, and the peer's global rank.

        The last stage's end is its ``lm_head.weight``, or the embedding copy the MTP blocks
        read (``split.embedding_copy``; a tied head is that same parameter there).
        """
        split = self.split
        linked = split.tied_across_ranks or split.embedding_copy
        if not linked or not (split.has_first or split.has_last):
            return None, -1
        inner: Any = self.model.model
        if split.has_first:
            return inner.embed_tokens.weight, dist.get_global_rank(self.group, split.last_rank)
        if split.embedding_copy:
            return inner.embed_tokens.weight, dist.get_global_rank(self.group, split.first_rank)
        return self.model.get_parameter("lm_head.weight"), dist.get_global_rank(self.group, split.first_rank)

    def _exchange(self, mine: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``mine`` to ``peer`` and receive the peer's tensor of the same shape."""
        send = mine.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, peer, self.group), dist.P2POp(dist.irecv, recv, peer, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return recv

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        param, peer = self._tied_pair()
        if param is None:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        local = local_tensor(param.grad)
        local.add_(self._exchange(local, peer))

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Copy the embedding's values into the last stage's ``lm_head.weight`` (tied models).

        Both ends must be laid out alike (same local shard shape and DTensor placements);
        the check runs on every pp rank so they all fail together.
        """
        split = self.split
        if not (split.tied_across_ranks or split.embedding_copy):
            return
        param, peer = self._tied_pair()
        info = _describe(param) if param is not None else None
        infos: list[tuple[tuple[int, ...], str] | None] = [None] * split.pp_size
        dist.all_gather_object(infos, info, group=self.group)
        if infos[split.first_rank] != infos[split.last_rank]:
            raise ValueError(
                "tie_word_embeddings under pipeline parallelism: model.embed_tokens.weight (stage 0) and "
                f"lm_head.weight (last stage) are laid out differently ({infos[split.first_rank]} vs "
                f"{infos[split.last_rank]}); both ends need the same sharding"
            )
        if param is None:
            return
        if split.has_first:
            dist.send(local_tensor(param).contiguous(), peer, group=self.group)
        else:
            local = local_tensor(param)
            buf = torch.empty_like(local)
            dist.recv(buf, peer, group=self.group)
            local.copy_(buf)


def build_pipeline(
    split: PipelineSplit,
    model: nn.Module,
    pp_mesh: DeviceMesh | dist.ProcessGroup,
    *,
    device: torch.device | str,
    n_microbatches: int,
    schedule: str | None = None,
    dxdw_split: bool = False,
    aux_coef: float = 0.0,
    lm_loss: LMLoss | None = None,
    mtp_coef: float = 0.0,
) -> Pipeline:
    """Build this rank's ``PipelineStage`` objects and the schedule, after FSDP and materialisation.

    Args:
        split: From ``split_model``.
        model: ``split.model`` after TP/FSDP/materialisation (the same object).
        pp_mesh: The 1-D "pp" DeviceMesh (or its ProcessGroup).
        device: Device the stages run on.
        n_microbatches: Micro-batches per optimizer step (the gradient-accumulation steps).
        schedule: ``parallelism.pipeline_parallel_schedule`` (default: the one given to
            ``split_model``): gpipe, 1f1b, interleaved (interleaved1f1b), zero_bubble
            (interleaved zero bubble) or zbv.
        dxdw_split: ``parallelism.pipeline_parallel_enable_dxdw_split``: run the interleaved
            schedule as its zero-bubble variant (separate input- and weight-gradient passes).
        aux_coef: The router aux loss coefficient (the trainer's ``aux_coef``). When non-zero
            and the model has the aux loss (MoE family, ``output_router_logits``), every
            micro-batch's loss gets ``aux_coef * aux * valid_tokens / global_tokens``, exactly
            as ``Trainer.forward_backward`` adds it, and ``Pipeline.aux_sum`` the logged value.
        lm_loss: The run's loss (``kernels.chunk_loss_size``, ``fused_linear_cross_entropy``,
            ``compile``); with a chunked or fused loss the last stage hands the normed hidden
            states to it, and it applies ``lm_head`` chunk by chunk. None: the plain loss.
        mtp_coef: ``training.mtp_loss_scaling_factor`` for a model with MTP blocks: in training
            the last stage runs them and each micro-batch adds ``mtp_coef * mtp / global_tokens``
            (as ``Trainer.forward_backward``); ``Pipeline.mtp_sum`` is the logged ``mtp_loss``.

    Returns:
        The pipeline; its tied weights (if any) are already equal on both ends.

    Raises:
        ValueError: naming the config key when the schedule does not match the split or the
            micro-batch count does not fit the schedule.
    """
    name = canonical_schedule(schedule or split.schedule)
    if dxdw_split and name not in ZERO_BUBBLE:
        if name != "interleaved1f1b":
            raise ValueError(
                f"parallelism.pipeline_parallel_enable_dxdw_split: needs an interleaved or zero-bubble "
                f"schedule ({SCHEDULE_KEY}: interleaved, zero_bubble or zbv), not {name!r}"
            )
        name = "interleavedzerobubble"
    if name != split.schedule and SCHEDULES[name][1:] != SCHEDULES[split.schedule][1:]:
        raise ValueError(f"{SCHEDULE_KEY}: {name!r} does not match the split made for {split.schedule!r}")
    if model is not split.model:
        raise ValueError("build_pipeline: `model` must be split.model (after FSDP/materialisation)")
    group = pp_mesh if isinstance(pp_mesh, dist.ProcessGroup) else pp_mesh.get_group()
    if dist.get_world_size(group) != split.pp_size or dist.get_rank(group) != split.pp_rank:
        raise ValueError(
            f"build_pipeline: the pp mesh (size {dist.get_world_size(group)}, rank {dist.get_rank(group)}) "
            f"does not match the split (pp_size {split.pp_size}, pp_rank {split.pp_rank})"
        )
    pipeline = Pipeline(
        split,
        model,
        group,
        device=torch.device(device),
        n_microbatches=n_microbatches,
        schedule_name=name,
        aux_coef=aux_coef,
        lm_loss=lm_loss,
        mtp_coef=mtp_coef,
    )
    pipeline.sync_tied_weights()
    return pipeline


__all__ = ["Pipeline", "build_pipeline", "check_microbatches"]
