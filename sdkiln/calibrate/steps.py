"""The latents after every denoising step, from any diffusers pipeline.

Calibration, the quality report and the cache search read the latents after each step (and a partial
run of the search replaces them). diffusers' pipelines offer ``callback_on_step_end`` for this; a few
do not (HunyuanVideo-1.5's, whose guidance comes from a guider component). For those, the
scheduler's ``step``, which a denoising loop calls once per step to compute the next latents, is
wrapped for the length of the call: the callback sees what it returns and may replace it, exactly as
through ``callback_on_step_end`` (same arguments, same return, exceptions pass through the pipeline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from sdkiln.errors import ModelError

StepCallback = Callable[[Any, int, Any, dict[str, Any]], dict[str, Any]]
"""``callback(pipeline, step, timestep, {"latents": tensor}) -> {"latents": tensor}``, diffusers' form."""


def has_step_callback(pipeline: Any) -> bool:
    """Whether the pipeline's call takes diffusers' ``callback_on_step_end``."""
    return "callback_on_step_end" in inspect.signature(type(pipeline).__call__).parameters


@contextlib.contextmanager
def on_step_end(pipeline: Any, callback: StepCallback) -> Iterator[dict[str, Any]]:
    """Yields the call arguments that make ``callback`` run after every denoising step of the calls
    made inside the block: diffusers' ``callback_on_step_end`` where the pipeline takes it, else none
    (the scheduler's ``step`` calls it, until the block ends)."""
    if has_step_callback(pipeline):
        yield {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents"]}
        return
    scheduler = pipeline.scheduler
    if getattr(scheduler, "order", 1) != 1:
        raise ModelError(
            f"{type(pipeline).__name__} has no callback_on_step_end and its {type(scheduler).__name__} "
            f"takes {scheduler.order} scheduler steps per denoising step: sdkiln cannot tell the steps apart"
        )
    original, own = scheduler.step, vars(scheduler).get("step")
    step = 0

    def step_and_call(model_output, timestep, sample, *args, **kwargs):
        nonlocal step
        out = original(model_output, timestep, sample, *args, **kwargs)
        latents = out[0] if isinstance(out, tuple) else out.prev_sample
        replaced = callback(pipeline, step, timestep, {"latents": latents}).get("latents", latents)
        step += 1
        if replaced is latents:
            return out
        if isinstance(out, tuple):
            return (replaced, *out[1:])
        return dataclasses.replace(out, prev_sample=replaced)

    scheduler.step = step_and_call
    try:
        yield {}
    finally:
        if own is None:
            del scheduler.step  # the class's method again
        else:
            scheduler.step = own
