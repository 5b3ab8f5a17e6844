"""W8A8 (static) at run time: int8 weights, activations quantized with calibrated parameters.

Activations are per-tensor asymmetric int8 with a scale and offset fixed at calibration; weights
are per-output-channel symmetric int8 (the same values as W8A8_DYNAMIC). The float bias and the
activation offset are folded into one int32 ``quant_bias``, so the layer is one integer matmul plus
one scale (Ascend's ``npu_quant_matmul``):

    s_x = (max - min) / 255,   o_x = round(-min / s_x) - 128          (the range is widened to hold 0)
    x_q = clamp(round(x / s_x + o_x), -128, 127)
    deq_scale[n] = s_x * s_w[n]                                        (rounded to 10 mantissa bits)
    quant_bias[n] = round(bias[n] / deq_scale[n] - o_x * sum_k Wq[n, k])
    y = (x_q @ Wq.T + quant_bias) * deq_scale

Tensors (Ascend names): ``weight`` int8 [N, K], ``input_scale`` fp32 [1], ``input_offset`` fp32 [1]
(an integer in [-128, 127]), ``deq_scale`` fp32 [N], ``quant_bias`` int32 [N], and ``bias`` in the
model dtype [N] when the layer has one -- kept for the Ascend export and for audit; the forward
never adds it, since ``quant_bias`` already holds it. ``s_x`` and ``deq_scale`` sit on the grids of
``sdkiln.runtime.quant.scales``, so MindIE SD's casts of them change nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.scales import fp19_nearest, half_exact
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear

# |x_q @ Wq.T| <= K * 128 * 128 (both in [-128, 127]); quant_bias must leave room for it in int32.
_INT32_MAX = 2**31 - 1


def activation_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_scale, input_offset) in fp32, elementwise over calibrated ranges [lo, hi].

    The range is widened to hold 0, so the offset is an int8 value; an all-zero range gets scale 1.
    The scale is rounded up onto ``half_exact``'s grid (MindIE SD runs it in bfloat16), and the
    offset derived from that scale in float64 (``round(-lo / scale) - 128``, half to even).
    """
    lo, hi = lo.double().clamp(max=0.0), hi.double().clamp(min=0.0)
    scale = ((hi - lo) / 255.0).float()
    scale = half_exact(torch.where(scale > 0, scale, torch.ones_like(scale)), up=True)
    offset = torch.round(-lo / scale.double()) - 128.0
    return scale, offset.float()


def static_params(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor,
    input_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(deq_scale fp32, quant_bias int32), one row per leading index of ``input_scale`` ([1] or [T, 1]).

    ``deq_scale`` is ``input_scale * weight_scale`` rounded to ``fp19_nearest`` (what CANN keeps of it
    for float16 output). ``quant_bias`` is computed from that ``deq_scale``; see ``quant_bias``.
    """
    lead = input_scale.shape[:-1]
    deq = fp19_nearest(input_scale.float().reshape(*lead, 1) * weight_scale.float().reshape(-1))
    return deq, quant_bias(weight, bias, deq, input_offset)


def quant_bias(
    weight: torch.Tensor, bias: torch.Tensor | None, deq_scale: torch.Tensor, input_offset: torch.Tensor
) -> torch.Tensor:
    """``round(bias / deq_scale - input_offset * sum_k Wq)`` as int32, one row per row of ``deq_scale``.

    Computed in float64 (``o_x * sum_k Wq`` is an exact integer there) and rounded half to even; a
    value that could overflow the int32 accumulator raises.
    """
    deq = deq_scale.float()
    lead = deq.shape[:-1]
    wsum = weight.to(torch.int64).sum(dim=1).double()
    fbias = (
        torch.zeros(weight.shape[0], dtype=torch.float64, device=weight.device)
        if bias is None
        else bias.double()
    )
    qb = torch.round(fbias / deq.double() - input_offset.double().reshape(*lead, 1) * wsum)
    room = _INT32_MAX - weight.shape[1] * 128 * 128
    if bool((qb.abs() > room).any()):
        raise ValueError(
            f"quant_bias reaches {qb.abs().max().item():.3g}, beyond what an int32 accumulator over K="
            f"{weight.shape[1]} can add safely ({room}); the bias is too large for the calibrated input "
            "range: exclude this layer"
        )
    return qb.to(torch.int32)


class W8A8StaticLinear(QuantLinear):
    """int8 weight, int8 activations with one calibrated scale/offset per tensor (W8A8)."""

    scheme = "W8A8"
    recipe_kind = "w8a8_static"
    needs_ranges = True
    ascend_rank = 5
    onnx_form = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.float32, device=None):
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32, device=device))
        self.register_buffer("input_offset", torch.empty(1, dtype=torch.float32, device=device))
        self.register_buffer("deq_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.register_buffer("quant_bias", torch.empty(out_features, dtype=torch.int32, device=device))
        self._init_linear(in_features, out_features, bias, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges) -> W8A8StaticLinear:
        """Quantize ``linear`` for inputs calibrated to the range [ranges.min, ranges.max]."""
        dyn = W8A8DynamicLinear.from_linear(linear)
        device = linear.weight.device  # every tensor on the weight's device (a pipeline on CUDA)
        scale, offset = activation_params(
            torch.tensor([float(ranges.min)], device=device), torch.tensor([float(ranges.max)], device=device)
        )
        bias = None if linear.bias is None else linear.bias.detach()
        deq, qb = static_params(dyn.weight, dyn.weight_scale, bias, scale, offset)
        mod = cls(
            linear.in_features, linear.out_features, bias is not None, linear.weight.dtype, dyn.weight.device
        )
        mod.weight.copy_(dyn.weight)
        mod.input_scale.copy_(scale)
        mod.input_offset.copy_(offset)
        mod.deq_scale.copy_(deq)
        mod.quant_bias.copy_(qb)
        if bias is not None:
            mod.bias.copy_(bias)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a8_static_linear_from_float(
            x, self.input_scale, self.input_offset, self.weight, self.deq_scale, self.quant_bias
        )
