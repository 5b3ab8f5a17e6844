"""W8A8_DYNAMIC at run time: int8 weights, activations quantized per token on the fly.

Tensor names follow Ascend's msModelSlim format (``weight``, ``weight_scale``, ``weight_offset``,
``bias``), so the package's safetensors and the Ascend export share one naming.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.scales import half_exact

INT8_WEIGHT_RANGE = (-128, 127)
WEIGHT_HALF_RANGE = 127.5
"""The int8 weight grid: ``scale = absmax / 127.5`` per output channel, values in [-128, 127] (the
grid of torchao's symmetric mapping; chosen over ``absmax / 127`` by end-to-end PSNR on the
embedded model, docs/benchmarks.md)."""


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of ``w`` [N, K]: (values int8 [N, K] in [-128, 127], fp32
    scale [N, 1] = absmax / 127.5 rounded up onto ``half_exact``'s grid, 1 for an all-zero row).
    Rounds half to even; only a row's largest positive weight can round to 128, and it is clamped
    to 127."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / WEIGHT_HALF_RANGE
    scale = half_exact(torch.where(scale > 0, scale, torch.ones_like(scale)), up=True)
    return torch.round(w / scale).clamp_(*INT8_WEIGHT_RANGE).to(torch.int8), scale


class W8A8DynamicLinear(QuantLinear):
    """int8 per-channel symmetric weight (``int8_weight``); activations quantized per token at run
    time (W8A8_DYNAMIC).

    y = (q(x) @ Wq^T) * s_x * s_w + bias, accumulated exactly in int32 by ``sdkiln::w8a8_linear``.
    """

    scheme = "W8A8_DYNAMIC"
    recipe_kind = "w8a8_dynamic"
    weight_range = INT8_WEIGHT_RANGE
    ascend_rank = 3
    onnx_form = True
    torchao_config = "Int8DynamicActivationInt8WeightConfig"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.float32, device=None):
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        self.register_buffer(
            "weight_offset", torch.empty(out_features, 1, dtype=torch.float32, device=device)
        )
        self._init_linear(in_features, out_features, bias, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges=None) -> W8A8DynamicLinear:
        values, scale = int8_weight(linear.weight)
        mod = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            linear.weight.dtype,
            linear.weight.device,
        )
        mod.weight.copy_(values)
        mod.weight_scale.copy_(scale)
        mod.weight_offset.zero_()
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        return mod

    def set_values(self, values: torch.Tensor) -> None:
        self.weight.copy_(values.to(torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.w8a8_linear_from_float(x, self.weight, self.weight_scale, self.bias)


W8A8Linear = W8A8DynamicLinear
"""The name before milestone 2 (it ran W8A8_DYNAMIC); kept for code that imports it."""
