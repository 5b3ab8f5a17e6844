"""The step tracker reports the scheduler's real denoising step, not a count of transformer calls."""

import gc
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from sdkiln.errors import StepError
from sdkiln.model_zoo import get_spec
from sdkiln.runtime.denoising import attach_step_tracker, detach_step_tracker, step_tracker


def record_steps(pipe, layer: str) -> list[tuple[int, int]]:
    """Attach a tracker and log (step, num_steps) each time ``layer`` (inside the transformer) runs."""
    tracker = attach_step_tracker(pipe)
    seen = []
    pipe.transformer.get_submodule(layer).register_forward_pre_hook(
        lambda m, a: seen.append((tracker.step, tracker.num_steps))
    )
    return seen


def run(pipe, spec, **overrides):
    call = {**spec.call_kwargs(), "output_type": "latent", **overrides}
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        pipe(prompt="a photo of a dog", generator=torch.Generator().manual_seed(0), **call)


def test_flux_true_cfg_calls_the_transformer_twice_per_step():
    spec = get_spec("flux-tiny")
    pipe = spec.build()
    seen = record_steps(pipe, "transformer_blocks.0.attn.to_q")
    run(pipe, spec)
    assert seen == [(0, 4), (0, 4), (1, 4), (1, 4), (2, 4), (2, 4), (3, 4), (3, 4)]
    seen.clear()
    run(pipe, spec, num_inference_steps=3)  # a new call starts from step 0 again
    assert seen == [(0, 3), (0, 3), (1, 3), (1, 3), (2, 3), (2, 3)]


def test_sd3_batches_cfg_into_one_call_per_step():
    spec = get_spec("sd3-tiny")
    pipe = spec.build()
    seen = record_steps(pipe, "transformer_blocks.0.attn.to_q")
    run(pipe, spec)
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]


class Recorder(nn.Module):
    """A transformer stand-in that logs the tracker's step when it runs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        tracker = step_tracker(self)
        self.seen.append((tracker.step, tracker.num_steps))
        return -x


class LoopPipeline:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.transformer = Recorder()


@pytest.mark.parametrize("begin", [None, 2])
def test_a_stepped_scheduler_drives_the_step_including_a_begin_index(begin):
    pipe = LoopPipeline(FlowMatchEulerDiscreteScheduler())
    attach_step_tracker(pipe)
    sched = pipe.scheduler
    sched.set_timesteps(6)
    if begin is not None:
        sched.set_begin_index(begin)  # img2img: the run starts part-way through the schedule
    x = torch.ones(1, 4)
    for t in sched.timesteps[begin or 0 :]:
        x = sched.step(pipe.transformer(x), t, x).prev_sample
    assert pipe.transformer.seen == [(i, 6) for i in range(begin or 0, 6)]


def test_the_tracker_follows_a_swapped_scheduler_and_detaches():
    pipe = LoopPipeline(FlowMatchEulerDiscreteScheduler())
    tracker = attach_step_tracker(pipe)
    assert attach_step_tracker(pipe) is tracker
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()
    pipe.scheduler.set_timesteps(3)
    pipe.transformer(torch.ones(1))
    assert pipe.transformer.seen == [(0, 3)]
    detach_step_tracker(pipe.transformer)
    assert step_tracker(pipe.transformer) is None
    assert not pipe.transformer._forward_pre_hooks and not hasattr(pipe.transformer, "_sdkiln_step_tracker")


def test_schedulers_without_a_step_index_or_timesteps_are_refused():
    pipe = LoopPipeline(SimpleNamespace(timesteps=torch.arange(4)))
    attach_step_tracker(pipe)
    with pytest.raises(StepError, match="does not expose step_index"):
        pipe.transformer(torch.ones(1))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()
    pipe.scheduler.timesteps = None
    with pytest.raises(StepError, match="before scheduler.set_timesteps"):
        pipe.transformer(torch.ones(1))


def test_a_transformer_moved_to_another_pipeline_follows_it_once_reattached():
    old = LoopPipeline(FlowMatchEulerDiscreteScheduler())
    attach_step_tracker(old)
    new = LoopPipeline(FlowMatchEulerDiscreteScheduler())
    new.transformer = old.transformer
    with pytest.raises(StepError, match="follows another pipeline that still exists"):
        attach_step_tracker(new)
    del old
    gc.collect()
    new.scheduler.set_timesteps(5)
    with pytest.raises(StepError, match="no longer exists"):
        new.transformer(torch.ones(1))
    attach_step_tracker(new)
    new.transformer(torch.ones(1))
    assert new.transformer.seen[-1] == (0, 5)
