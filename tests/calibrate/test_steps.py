"""The step callback on a pipeline without ``callback_on_step_end`` (HunyuanVideo-1.5's): the scheduler's
step carries it, with diffusers' semantics (see, replace, stop), and is restored after."""

from __future__ import annotations

import pytest
import torch

from sdkiln.calibrate.steps import has_step_callback, on_step_end
from sdkiln.errors import ModelError
from sdkiln.model_zoo import get_spec


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def hv15():
    spec = get_spec("hunyuan-video-1.5-tiny")
    pipe = spec.build()
    pipe.set_progress_bar_config(disable=True)
    return spec, pipe


def _run(pipe, spec, callback):
    call = {**spec.call_kwargs(), "output_type": "latent"}
    with on_step_end(pipe, callback) as extra:
        assert extra == {}  # nothing to pass: the scheduler calls back
        return pipe(prompt="a red cube", generator=torch.Generator().manual_seed(0), **call).frames


def test_the_scheduler_step_calls_back_and_may_replace_the_latents(hv15):
    spec, pipe = hv15
    assert not has_step_callback(pipe)
    seen = {}

    def record(_pipe, step, _t, kwargs):
        seen[step] = kwargs["latents"].clone()
        return kwargs

    final = _run(pipe, spec, record)
    steps = spec.call_kwargs()["num_inference_steps"]
    assert sorted(seen) == list(range(steps)) and torch.equal(seen[steps - 1], final)
    assert "step" not in vars(pipe.scheduler)  # the class's method again

    def same(_pipe, step, _t, kwargs):  # a replacement by equal latents changes nothing
        return {"latents": seen[step].clone()} if step == 1 else kwargs

    assert torch.equal(_run(pipe, spec, same), final)

    def zero(_pipe, step, _t, kwargs):
        return {"latents": torch.zeros_like(kwargs["latents"])} if step == steps - 1 else kwargs

    assert not _run(pipe, spec, zero).any()


def test_an_exception_from_the_callback_ends_the_call_and_restores_the_scheduler(hv15):
    spec, pipe = hv15

    def stop(_pipe, step, _t, kwargs):
        if step == 1:
            raise _Stop
        return kwargs

    with pytest.raises(_Stop):
        _run(pipe, spec, stop)
    assert "step" not in vars(pipe.scheduler)


def test_a_multistep_scheduler_without_the_callback_is_refused():
    class Heun:
        order = 2

    class NoCallback:
        scheduler = Heun()

        def __call__(self):
            pass

    with pytest.raises(ModelError, match="2 scheduler steps per denoising step"):
        with on_step_end(NoCallback(), lambda *a: a[-1]):
            pass
