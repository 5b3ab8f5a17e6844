"""A SmoothQuant input multiplier in front of a linear layer.

SmoothQuant divides a linear's input by a per-channel factor s and multiplies the weight's columns
by s, which moves activation outliers into the weight. Where the input comes from an adaLN
modulation the division is folded into the modulation and nothing is left at run time; elsewhere
the layer keeps the multiplier ``1/s`` as ``<layer>.div.mul_scale`` and its own tensors move under
``<layer>.linear.*`` (the names MindIE SD reads). A manifest entry with ``"smooth": true`` asks the
loader to wrap the scheme's module this way.
"""

from __future__ import annotations

import torch
from torch import nn


class MulScale(nn.Module):
    """``x * mul_scale`` per input channel, computed in fp32 and rounded once to x's dtype."""

    def __init__(self, in_features: int, device=None):
        super().__init__()
        self.register_buffer("mul_scale", torch.empty(in_features, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.mul_scale).to(x.dtype)


class SmoothedLinear(nn.Module):
    """``linear(div(x))``: a (float or quantized) linear whose input is first multiplied by ``1/s``."""

    def __init__(self, linear: nn.Module, in_features: int, device=None):
        super().__init__()
        self.div = MulScale(in_features, device)
        self.linear = linear

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth_scale: torch.Tensor) -> SmoothedLinear:
        """Smooth a float ``linear`` by ``smooth_scale`` (s, [K], positive): weight columns times s,
        input times 1/s. The result equals ``linear`` up to float rounding. Computed in float64, so an
        s whose inverse is a float32 value gives exactly that ``mul_scale``."""
        s = smooth_scale.detach().double()
        scaled = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
        scaled = scaled.to(device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            scaled.weight.copy_(linear.weight.double() * s)
            if linear.bias is not None:
                scaled.bias.copy_(linear.bias)
        mod = cls(scaled, linear.in_features, linear.weight.device)
        mod.div.mul_scale.copy_(1.0 / s)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.div(x))
