"""The denoising step index, published to the modules that depend on it.

Per-step schemes (W8A8_TIMESTEP), per-step calibration and step-dependent caches need to know
which denoising step the transformer is computing. Counting transformer calls gets this wrong: with
classifier-free guidance a pipeline may call the transformer twice per step (FLUX's true CFG, Wan) or
once with a doubled batch (SD3), and an img2img run starts part-way through the schedule. So the
index is read from the pipeline's scheduler, the one object that knows it: ``scheduler.step_index``,
which diffusers schedulers advance in ``scheduler.step()`` after the transformer ran. Before the
first ``step()`` of a run it is None, and the step is ``scheduler.begin_index`` if the pipeline set
one (img2img) and 0 otherwise. The run's step count is ``len(scheduler.timesteps)``.

``DenoisingStepTracker`` is a forward pre-hook on the transformer (the transformer's attribute
``_sdkiln_step_tracker`` names it; ``detach_step_tracker`` removes it): before each transformer call
it reads the scheduler of the pipeline it was attached to (``pipeline.scheduler`` at that moment, so
a swapped scheduler is followed) and publishes ``step`` and ``num_steps``. Being a torch module
hook under ``torch.compiler.disable``, it runs outside the compiled region when the transformer is
``torch.compile``d, so reading the scheduler never enters a graph. Modules that need the step declare ``needs_step = True``;
``attach_step_tracker`` registers them and the tracker calls their ``set_step(step, num_steps)``
before every call, so a compiled module reads the step only as what ``set_step`` made of it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from sdkiln.errors import StepError

ATTRIBUTE = "_sdkiln_step_tracker"


class DenoisingStepTracker:
    """Publishes the pipeline's current denoising step (``step``) and step count (``num_steps``)."""

    def __init__(self, pipeline: Any):
        self._pipeline = weakref.ref(pipeline)
        self._handle = None
        self.step: int | None = None
        self.num_steps: int | None = None
        self.modules: list[nn.Module] = []
        """The modules with ``needs_step``, told the step on every update."""

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args) -> None:
        self.update()

    def update(self) -> None:
        pipeline = self._pipeline()
        if pipeline is None:
            raise StepError(
                "the pipeline this transformer's step tracker follows no longer exists; call "
                "sdkiln.runtime.denoising.attach_step_tracker(pipe) on the pipeline that now holds the transformer"
            )
        scheduler = pipeline.scheduler
        if not hasattr(scheduler, "step_index"):
            raise StepError(
                f"{type(scheduler).__name__} does not expose step_index; per-step schemes need a scheduler "
                "that does (every flow-matching and multistep scheduler in diffusers)"
            )
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is None:
            raise StepError(
                "the transformer ran before scheduler.set_timesteps(); run it through its pipeline"
            )
        index = scheduler.step_index
        if index is None:
            index = getattr(scheduler, "begin_index", None) or 0
        self.step, self.num_steps = int(index), len(timesteps)
        for module in self.modules:
            module.set_step(self.step, self.num_steps)


def _unwrapped(transformer: nn.Module) -> nn.Module:
    """The module itself when ``transformer`` is a ``torch.compile`` wrapper."""
    return getattr(transformer, "_orig_mod", transformer)


def step_tracker(transformer: nn.Module) -> DenoisingStepTracker | None:
    """The tracker attached to ``transformer``, if any."""
    return getattr(_unwrapped(transformer), ATTRIBUTE, None)


def attach_step_tracker(pipeline: Any, transformer_attr: str = "transformer") -> DenoisingStepTracker:
    """Attach a tracker to the pipeline's transformer (or reuse the one there) and register every
    module with ``needs_step`` with it. Call it again after swapping in such modules, and after moving
    the transformer into a new pipeline once the old one is gone."""
    transformer = _unwrapped(getattr(pipeline, transformer_attr))
    tracker = step_tracker(transformer)
    if tracker is None:
        tracker = DenoisingStepTracker(pipeline)
        tracker._handle = transformer.register_forward_pre_hook(tracker)
        setattr(transformer, ATTRIBUTE, tracker)
    elif tracker._pipeline() is None:
        tracker._pipeline = weakref.ref(pipeline)
    elif tracker._pipeline() is not pipeline:
        raise StepError(
            "this transformer's step tracker follows another pipeline that still exists; "
            "detach_step_tracker(transformer) first"
        )
    tracker.modules = [m for m in transformer.modules() if getattr(m, "needs_step", False)]
    return tracker


def detach_step_tracker(transformer: nn.Module) -> None:
    """Remove the tracker from ``transformer`` and unbind it from its modules."""
    transformer = _unwrapped(transformer)
    tracker = step_tracker(transformer)
    if tracker is None:
        return
    tracker._handle.remove()
    delattr(transformer, ATTRIBUTE)
    for module in tracker.modules:
        module.set_step(None, None)
    tracker.modules = []


def needs_step_tracker(transformer: nn.Module) -> bool:
    """Whether something still follows the step: a module with ``needs_step``, or an attention plan
    (block-sparse, quantized) on the transformer's attention route."""
    from sdkiln.runtime.attention.route import attention_route

    route = attention_route(transformer)
    if route is not None and (route.sparse is not None or route.quantized is not None):
        return True
    return any(getattr(m, "needs_step", False) for m in _unwrapped(transformer).modules())
