"""Mamba-3's pipeline stage preparation: the document numbers every mixer restarts its state at."""

from __future__ import annotations

from meshforge.models.common.stage import LayerRunner, StageBatch
from meshforge.models.mamba3.scan import document_index


def mamba3_stage(b: StageBatch) -> LayerRunner:
    """``Mamba3Model.forward``'s preparation: documents from ``segment_ids``/``position_ids``."""
    doc = document_index(b.segment_ids, b.position_ids, b.ids.shape)
    return lambda layer, x: layer(x, doc)
