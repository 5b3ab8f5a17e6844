"""Denoising trajectories of a batch of calibration samples, and cheap partial runs of them.

A cache search measures what reusing blocks over steps ``s+1 .. j`` does to the latents. Running
the whole pipeline for every candidate would cost the ``s`` steps before it again and again, so
``Trajectories`` records the uncached run's latents before every step once (``reference``), and a
partial run (``run(schedule, start, stop)``) replays the steps before ``start`` with a stub
transformer that costs nothing (its output is discarded: the latents before ``start`` are replaced
by the recorded ones in the pipeline's step callback; every transformer of the pipeline's, so a
Wan2.2-A14B expert's run replays the other expert's steps too), runs steps ``start .. stop`` for real, and
stops the pipeline after step ``stop``. Any pipeline with ``output_type="latent"`` works (the step
callback: ``calibrate.steps``), including its classifier-free guidance, unchanged.

All samples of the plan run as one batch (one prompt and one generator per sample).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from sdkiln.calibrate.steps import on_step_end
from sdkiln.model_zoo import ModelSpec
from sdkiln.runtime.cache import reset_cache
from sdkiln.runtime.denoising import attach_step_tracker, detach_step_tracker, step_tracker

STUB_HOOK = "sdkiln_replay_stub"


class _Stop(Exception):
    """Raised from the step callback to end a partial run after its last step."""


class _ReplayStub(ModelHook):
    """Before step ``start`` the transformer returns zeros without computing anything. The zeros have
    the output's shape, which is the model's to say (Wan image-to-video reads 36 channels and returns
    16): ``shapes`` maps an input's shape to it, learnt from one real call per input shape."""

    def __init__(self, tracker, start: int, shapes: dict, searched: bool = True):
        super().__init__()
        self.tracker, self.start, self.shapes, self.searched = tracker, start, shapes, searched

    def new_forward(self, module, *args, **kwargs):
        self.tracker.update()
        if self.tracker.step >= self.start:
            return self.fn_ref.original_forward(*args, **kwargs)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        key = tuple(hidden.shape)
        if key not in self.shapes:
            out = self.fn_ref.original_forward(*args, **kwargs)
            self.shapes[key] = tuple((out[0] if isinstance(out, tuple) else out.sample).shape)
            if self.searched:  # what a cache schedule stored in that call is not the replay's
                reset_cache(module)  # (another expert's schedule, replayed whole, keeps its full step)
        zeros = hidden.new_zeros(self.shapes[key])
        return (
            (zeros,) if kwargs.get("return_dict", True) is False else Transformer2DModelOutput(sample=zeros)
        )


class Trajectories:
    """``prompts`` x ``seeds`` (one sample each) at the deployment ``call`` (``spec.call_kwargs(...)``)."""

    def __init__(
        self, pipeline: Any, spec: ModelSpec, prompts: list[str], seeds: list[int], call: dict[str, Any]
    ):
        self.pipeline, self.spec = pipeline, spec
        self.prompts, self.seeds = list(prompts), list(seeds)
        self.call = {**call, "output_type": "latent"}
        self.num_steps = int(self.call["num_inference_steps"])
        self._reference: list[torch.Tensor] | None = None
        self._output_shapes: dict[tuple, tuple] = {}

    @property
    def transformer(self):
        return getattr(self.pipeline, self.spec.transformer_attr)

    def _generators(self) -> list[torch.Generator]:
        return [torch.Generator("cpu").manual_seed(s) for s in self.seeds]

    @torch.inference_mode()
    def _call(self, callback) -> None:
        """One pipeline call over the plan; ``callback`` records what it needs and may stop the run."""
        self.pipeline.set_progress_bar_config(disable=True)
        call = dict(self.call)
        if "negative_prompt" in call:
            call["negative_prompt"] = [call["negative_prompt"]] * len(self.prompts)
        try:
            with on_step_end(self.pipeline, callback) as extra:
                self.pipeline(
                    prompt=self.prompts,
                    generator=self._generators(),
                    **extra,
                    **call,
                    **self.spec.condition(call, len(self.prompts)),
                )
        except _Stop:
            pass

    def reference(self) -> list[torch.Tensor | None]:
        """The uncached run's latents (fp32, CPU): entry t for t in 1..T holds the latents before step
        t (entry T: the final latents); entry 0 is None, since a run from step 0 draws its noise from
        the seeds."""
        if self._reference is None:
            after: list[torch.Tensor] = []

            def record(_pipe, step, _t, kwargs):
                after.append(kwargs["latents"].detach().float().cpu().clone())
                return kwargs

            self._call(record)
            if len(after) != self.num_steps:
                raise RuntimeError(f"the pipeline ran {len(after)} steps, expected {self.num_steps}")
            self._reference = [None, *after]  # entry t (t >= 1): the latents before step t
        return self._reference

    def set_reference(self, after: list[torch.Tensor]) -> None:
        """Adopt the latents after every step of an uncached ``run()`` as the reference."""
        if len(after) != self.num_steps:
            raise ValueError(f"{len(after)} latents for {self.num_steps} steps")
        self._reference = [None, *after]

    def final(self) -> torch.Tensor:
        return self.reference()[-1]

    def run(self, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """The latents after each step ``start .. stop`` (default: to the last step) of a run that
        starts from the reference latents before step ``start`` and computes those steps with whatever
        hooks the transformer carries (a cache schedule); ``start`` 0 is an ordinary run from the
        noise. A cache runner on the transformer is reset first, so nothing of an earlier run is reused."""
        stop = self.num_steps - 1 if stop is None else stop
        if not 0 <= start <= stop < self.num_steps:
            raise ValueError(f"need 0 <= start <= stop < {self.num_steps}, got start {start}, stop {stop}")
        reference = self.reference() if start > 0 else None
        after: list[torch.Tensor] = []

        def callback(_pipe, step, _t, kwargs):
            latents = kwargs["latents"]
            if step == start - 1:
                kwargs["latents"] = reference[start].to(device=latents.device, dtype=latents.dtype)
            if step >= start:
                after.append(latents.detach().float().cpu().clone())
            if step == stop:
                raise _Stop
            return kwargs

        reset_cache(self.transformer)
        if start == 0:
            self._call(callback)
            return after
        had_tracker = step_tracker(self.transformer) is not None
        tracker = attach_step_tracker(self.pipeline, self.spec.transformer_attr)
        # every transformer of the pipeline replays: an expert's window may start after another's steps
        replayed = [c for c in self.pipeline.components.values() if type(c) is type(self.transformer)]
        registries = [HookRegistry.check_if_exists_or_initialize(c) for c in replayed]
        for registry, c in zip(registries, replayed, strict=True):
            stub = _ReplayStub(tracker, start, self._output_shapes, searched=c is self.transformer)
            registry.register_hook(stub, STUB_HOOK)
        try:
            self._call(callback)
        finally:
            for registry in registries:
                registry.remove_hook(STUB_HOOK, recurse=False)
            if not had_tracker:  # leave the pipeline as it was found
                detach_step_tracker(self.transformer)
        return after
