"""W8A8_TIMESTEP at run time: static int8 activation parameters per denoising step, dynamic early on.

Activation ranges of a diffusion transformer drift across the denoising steps, so one static range
per layer either clips late steps or wastes resolution on early ones. This scheme (MindIE's
timestep policy) keeps one static row per step and quantizes the first ``dynamic_steps`` steps
per token at run time instead, where the ranges move fastest:

    step t < dynamic_steps:  x_q, s_x = quantize_per_token(x);  y = w8a8_linear(x_q, s_x, weight, weight_scale, bias)
    step t >= dynamic_steps: y = W8A8 static with row t (see ``w8a8_static``)

Tensors (Ascend names; T = ``num_steps``): ``weight`` int8 [N, K]; ``weight_scale`` fp32 [N, 1] and
``weight_offset`` fp32 [N, 1] (zeros) for the dynamic steps; ``input_scale`` and ``input_offset``
fp32 [T, 1], ``deq_scale`` fp32 [T, N] and ``quant_bias`` int32 [T, N] for the static steps (every
row is calibrated, also those the policy runs dynamically); ``bias`` in the model dtype [N].

The step comes from the pipeline's scheduler: ``sdkiln.runtime.denoising``'s tracker (``sdkiln.load``
attaches it) calls ``set_step`` before every transformer call, outside any compiled region. A run
whose step count differs from ``num_steps`` is refused there: row t of a 4-step calibration does
not describe step t of an 8-step run. The forward reads the step only as a one-element index tensor
and a "dynamic" flag, so a compiled transformer has one graph for the dynamic steps and one for the
static ones, whatever the step count.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.errors import StepError
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear
from sdkiln.runtime.quant.w8a8_static import activation_params, static_params


def runs_dynamic(step: int, dynamic_steps: int) -> bool:
    """The policy: quantize activations per token at run time for the first ``dynamic_steps`` steps."""
    return step < dynamic_steps


class W8A8TimestepLinear(QuantLinear):
    """int8 weight; per-step static activation parameters, per-token dynamic ones for early steps."""

    scheme = "W8A8_TIMESTEP"
    recipe_kind = "w8a8_timestep"
    needs_ranges = True
    needs_step = True
    ascend_rank = 4

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype=torch.float32,
        device=None,
        *,
        num_steps: int,
        dynamic_steps: int,
    ):
        super().__init__()
        if num_steps < 1 or not 0 <= dynamic_steps <= num_steps:
            raise ValueError(
                f"need num_steps >= 1 and 0 <= dynamic_steps <= num_steps, got {num_steps}, {dynamic_steps}"
            )
        self.num_steps, self.dynamic_steps = num_steps, dynamic_steps
        self._dynamic: bool | None = None
        self._row: torch.Tensor | None = None
        self._steps: torch.Tensor | None = None
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, 1, **f32))
        self.register_buffer("weight_offset", torch.empty(out_features, 1, **f32))
        self.register_buffer("input_scale", torch.empty(num_steps, 1, **f32))
        self.register_buffer("input_offset", torch.empty(num_steps, 1, **f32))
        self.register_buffer("deq_scale", torch.empty(num_steps, out_features, **f32))
        self.register_buffer(
            "quant_bias", torch.empty(num_steps, out_features, dtype=torch.int32, device=device)
        )
        self._init_linear(in_features, out_features, bias, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges, dynamic_steps: int = 0) -> W8A8TimestepLinear:
        """Quantize ``linear`` for inputs calibrated to [step_min[t], step_max[t]] at step t
        (``ranges.step_min`` and ``ranges.step_max``, [T] each); the first ``dynamic_steps`` steps
        run dynamically."""
        device = linear.weight.device  # the observers' statistics may live elsewhere
        step_min, step_max = ranges.step_min.to(device), ranges.step_max.to(device)
        dyn = W8A8DynamicLinear.from_linear(linear)
        t = step_min.numel()
        scale, offset = activation_params(step_min.reshape(t, 1), step_max.reshape(t, 1))
        bias = None if linear.bias is None else linear.bias.detach()
        deq, qb = static_params(dyn.weight, dyn.weight_scale, bias, scale, offset)
        mod = cls(
            linear.in_features,
            linear.out_features,
            bias is not None,
            linear.weight.dtype,
            dyn.weight.device,
            num_steps=t,
            dynamic_steps=dynamic_steps,
        )
        for name, value in [
            ("weight", dyn.weight),
            ("weight_scale", dyn.weight_scale),
            ("weight_offset", dyn.weight_offset),
            ("input_scale", scale),
            ("input_offset", offset),
            ("deq_scale", deq),
            ("quant_bias", qb),
        ]:
            getattr(mod, name).copy_(value)
        if bias is not None:
            mod.bias.copy_(bias)
        return mod

    def params(self) -> dict:
        return {"num_steps": self.num_steps, "dynamic_steps": self.dynamic_steps}

    def set_step(self, step: int | None, num_steps: int | None) -> None:
        """The denoising step of the next calls and the run's step count; None unbinds the layer."""
        if step is None:
            self._dynamic = self._row = None
            return
        if num_steps != self.num_steps:
            raise StepError(
                f"this model's W8A8_TIMESTEP layers were calibrated for {self.num_steps} denoising steps but the "
                f"pipeline runs {num_steps}: run it with num_inference_steps={self.num_steps}, or optimize again "
                f"for {num_steps} (sdkiln optimize --steps {num_steps})"
            )
        if not 0 <= step < self.num_steps:
            raise StepError(f"denoising step {step} is outside the {self.num_steps} calibrated steps")
        device = self.input_scale.device
        if self._steps is None or self._steps.device != device:
            self._steps = torch.arange(self.num_steps, device=device)
        self._dynamic, self._row = runs_dynamic(step, self.dynamic_steps), self._steps[step : step + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dynamic is None:
            raise StepError(
                "a W8A8_TIMESTEP layer needs the denoising step: load the package with sdkiln.load, or call "
                "sdkiln.runtime.denoising.attach_step_tracker(pipeline) after building the pipeline yourself"
            )
        if self._dynamic:
            return kernels.w8a8_linear_from_float(x, self.weight, self.weight_scale, self.bias)
        row, n = self._row, self.out_features
        scale, offset = (
            self.input_scale.index_select(0, row).reshape(1),
            self.input_offset.index_select(0, row).reshape(1),
        )
        deq, quant_bias = (
            self.deq_scale.index_select(0, row).reshape(n),
            self.quant_bias.index_select(0, row).reshape(n),
        )
        return kernels.w8a8_static_linear_from_float(x, scale, offset, self.weight, deq, quant_bias)
