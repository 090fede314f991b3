"""Pipeline parallelism on ``torch.distributed.pipelining``: layer split, stage modules, schedules.

Modules: ``layout.py`` (schedule names, the stage layout arithmetic), ``split.py`` (pruning the
model to a rank's stages), ``stage.py`` (the stage forward and ``StageModule``), ``runtime.py``
(``Pipeline``: the schedule, its step and evaluation; ``build_pipeline``).

The trainer calls this in two places (see ``meshforge.train.build_model.build_model``):

1. ``split_model`` on the meta model, before TP/FSDP/materialisation: it decides which decoder
   layers every (virtual) stage runs and prunes the model in place to what this pp rank hosts.
   The layers stay under ``model.layers`` in a ``ModuleDict`` keyed by their *global* index, so
   parameter names (``model.layers.7.mlp.up_proj.weight``) are those of the whole model and a
   checkpoint saved in one pipeline layout loads in another. The embedding lives only where
   stage 0 runs, the final norm and head only where the last stage runs.
2. ``build_pipeline`` after FSDP and materialisation: one ``PipelineStage`` per local stage and
   the schedule. ``Pipeline.step`` then runs forward and backward of all micro-batches.

Why the stages call the pruned root model instead of its children: FSDP2 (applied by the
trainer to the whole pruned model) gathers the root's own parameters (embedding, norm, head) in
the root's forward hook. Each stage therefore runs ``root(x, ..., pp_stage=i)``; the root's class
is swapped for a subclass whose ``forward`` runs only stage ``i``'s part. ``StageModule`` still
registers the stage's layers (and embedding/head) as children so that ``parameters()`` of a
stage is exactly what it computes (the zero-bubble weight pass iterates it).

Tied embeddings: when stage 0 and the last stage are on different ranks, the last rank keeps
its own ``lm_head.weight``. ``build_pipeline`` copies the embedding's values into it (whatever
materialisation or checkpoint loading put there), and ``Pipeline.step`` sums the two gradients
over the two ranks, so both copies get the same update as the single tied weight would.

Families: every family whose spec has a stage preparation (``FamilySpec.stage_preparation``:
what a stage builds before its layers, masks and RoPE); ``stage.py`` holds the stage forward.
A spec's ``stage_check`` refuses a model its preparation cannot split: the transformers path
(``models/generic/stage.py``) splits models with the usual layout (``model.embed_tokens``,
``model.layers`` ModuleList, ``model.norm``, ``model.rotary_emb``, ``lm_head``) and a model type
whose forward a stage reproduces. A tied head is detected by the family's args or, where
transformers ties, by the shared Parameter, and the copy on the last rank is kept equal alike.

MoE router aux loss (``aux_coef`` of ``build_pipeline``): transformers' loss is one product
over the statistics of *all* MoE layers, which live on different stages. Each stage therefore
returns, next to the hidden states, a float32 ``carry`` of ``2 * E + 1`` values: the running
sums over the layers so far of the router probabilities (with autograd), the top-k assignments
and the rows (no gradient). The last stage forms the loss from the totals in its loss
function, so autograd sends ``d aux / d prob_sum`` (which needs the global assignment totals of
that micro-batch) back through the schedule's own gradient messages to every stage's routers:
exactly the single-process gradient, and the exact value for the log.
"""

from meshforge.parallel.pipeline.layout import (
    LAYERS_KEY,
    SCHEDULE_KEY,
    PipelineSplit,
    StageInfo,
    assign_layers,
    canonical_schedule,
    stage_rank,
)
from meshforge.parallel.pipeline.runtime import Pipeline, build_pipeline, check_microbatches
from meshforge.parallel.pipeline.split import split_model
from meshforge.parallel.pipeline.stage import StageModule, pipelined_class, router_aux_experts

__all__ = [
    "LAYERS_KEY",
    "SCHEDULE_KEY",
    "Pipeline",
    "PipelineSplit",
    "StageInfo",
    "StageModule",
    "assign_layers",
    "build_pipeline",
    "canonical_schedule",
    "check_microbatches",
    "pipelined_class",
    "router_aux_experts",
    "split_model",
    "stage_rank",
]
