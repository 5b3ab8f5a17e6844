"""W8A8_TIMESTEP: which path (dynamic, or static row t) runs at each denoising step, and refusals."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import sdkiln.kernels as K
from sdkiln.configs import W8A8TimestepConfig
from sdkiln.errors import StepError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.registry import TransformContext, apply_transform
from sdkiln.runtime.quant import Ranges
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear
from sdkiln.runtime.quant.w8a8_timestep import W8A8TimestepLinear

STEPS = 4
DYNAMIC = 2


@pytest.fixture
def spy(monkeypatch):
    """Log each activation quantization: ("dynamic",) or ("static", scale); ``spy.on`` gates it."""
    calls = []
    per_token, per_tensor = K.w8a8_linear_from_float, K.w8a8_static_linear_from_float

    def dynamic(x, *args):
        if spy_state.on:
            calls.append(("dynamic",))
        return per_token(x, *args)

    def static(x, scale, *args):
        if spy_state.on:
            calls.append(("static", scale.item()))
        return per_tensor(x, scale, *args)

    spy_state = SimpleNamespace(on=True, calls=calls)
    monkeypatch.setattr(K, "w8a8_linear_from_float", dynamic)
    monkeypatch.setattr(K, "w8a8_static_linear_from_float", static)
    return spy_state


def calibrated_layer():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    lo, hi = -torch.rand(STEPS) * 4 - 0.5, torch.rand(STEPS) * 4 + 0.5
    layer = W8A8TimestepLinear.from_linear(linear, Ranges(step_min=lo, step_max=hi), dynamic_steps=DYNAMIC)
    return linear, lo, hi, layer


def test_each_step_runs_the_dynamic_path_or_its_own_static_row(spy):
    linear, lo, hi, layer = calibrated_layer()
    x = torch.randn(3, 5, 32)
    for t in range(STEPS):
        layer.set_step(t, STEPS)  # what the step tracker does before each transformer call
        spy.calls.clear()
        with torch.no_grad():
            y = layer(x)
            expected = (
                W8A8DynamicLinear.from_linear(linear)(x)
                if t < DYNAMIC
                else W8A8StaticLinear.from_linear(linear, Ranges(float(lo[t]), float(hi[t])))(x)
            )
        assert torch.equal(y, expected)
        assert spy.calls[0] == (("dynamic",) if t < DYNAMIC else ("static", layer.input_scale[t].item()))
    assert layer.input_scale.shape == (STEPS, 1) and layer.deq_scale.shape == (STEPS, 16)
    assert layer.quant_bias.shape == (STEPS, 16) and layer.quant_bias.dtype == torch.int32
    assert torch.equal(layer.weight_offset, torch.zeros(16, 1))


def test_wrong_step_count_missing_tracker_and_out_of_range_step_are_refused():
    _, _, _, layer = calibrated_layer()
    x = torch.randn(2, 32)
    with pytest.raises(StepError, match="needs the denoising step"):
        layer(x)
    with pytest.raises(StepError, match="calibrated for 4 denoising steps but the pipeline runs 8"):
        layer.set_step(0, 8)
    with pytest.raises(StepError, match="outside the 4 calibrated steps"):
        layer.set_step(4, STEPS)
    layer.set_step(1, STEPS)
    layer(x)
    layer.set_step(None, None)  # detached: the step is unknown again
    with pytest.raises(StepError, match="needs the denoising step"):
        layer(x)


def test_policy_switches_at_the_chosen_step_in_a_real_pipeline(spy):
    """flux-tiny with true CFG: two transformer calls per step, each at the scheduler's step."""
    spec = get_spec("flux-tiny")
    pipe = spec.build()
    spy.on = False
    ctx = TransformContext(pipeline=pipe, spec=spec, forward_loop=None)
    result = apply_transform(ctx, W8A8TimestepConfig(calib_samples=1, dynamic_steps=(DYNAMIC,)))
    assert result.record["dynamic_steps"] == DYNAMIC and result.record["num_steps"] == STEPS
    layer = pipe.transformer.get_submodule("single_transformer_blocks.1.proj_out")
    layer.register_forward_pre_hook(lambda m, a: setattr(spy, "on", True))
    layer.register_forward_hook(lambda m, a, out: setattr(spy, "on", False))
    call = {**spec.call_kwargs(), "output_type": "latent"}
    with torch.inference_mode():
        pipe(prompt="a photo of a dog", generator=torch.Generator().manual_seed(0), **call)
    rows = [layer.input_scale[t].item() for t in range(STEPS)]
    assert spy.calls == [("dynamic",)] * 4 + [("static", rows[2])] * 2 + [("static", rows[3])] * 2
    with pytest.raises(StepError, match="run it with num_inference_steps=4"):
        pipe(prompt="a dog", **{**call, "num_inference_steps": 6})


def test_step_window_takes_the_union_of_neighbouring_ranges():
    from sdkiln.optimizer.quant.w8a8_timestep import window_range

    lo, hi = torch.tensor([0.0, -5, 0, 0, -1]), torch.tensor([1.0, 0, 3, 0, 0])
    assert window_range(lo, hi, 0) == (lo, hi)
    wlo, whi = window_range(lo, hi, 1)
    assert wlo.tolist() == [-5, -5, -5, -1, -1] and whi.tolist() == [1, 3, 3, 3, 0]
    wlo, whi = window_range(lo, hi, 10)  # wider than the run: the global range at every step
    assert wlo.tolist() == [-5] * 5 and whi.tolist() == [3] * 5
