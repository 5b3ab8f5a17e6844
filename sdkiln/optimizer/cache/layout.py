"""What a cache schedule needs to know about a model: its block layout and its run's sigmas."""

from __future__ import annotations

from typing import Any

from sdkiln.model_zoo.spec import ModelSpec
from sdkiln.runtime.cache.schedule import BlockLayout


def block_layout(spec: ModelSpec, transformer: Any) -> list[BlockLayout]:
    """The spec's block lists in stack order, with their lengths in ``transformer``."""
    return [
        BlockLayout(bl.attr, len(getattr(transformer, bl.attr)), tuple(bl.inputs), tuple(bl.outputs))
        for bl in spec.block_lists
    ]


def run_sigmas(pipeline: Any) -> list[float]:
    """The sigma of every step of the pipeline's last run (its scheduler keeps them)."""
    scheduler = pipeline.scheduler
    steps = len(scheduler.timesteps)
    return [float(s) for s in scheduler.sigmas.detach().cpu().flatten()[:steps]]
