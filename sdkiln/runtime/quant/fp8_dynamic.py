"""FP8_DYNAMIC at run time: float8_e4m3fn weights, activations cast to float8 per token on the fly.

Tensor names follow the Ascend/msModelSlim naming of the other schemes (``weight``,
``weight_scale``, ``bias``); the weight is symmetric, so no offset is stored.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.runtime.quant import register_quant_module


@register_quant_module
class FP8Linear(nn.Module):
    """float8_e4m3fn per-channel weight (``scale = absmax / 448``); activations quantized per token
    to float8 at run time (FP8_DYNAMIC).

    y = (q(x) @ Wq^T) * s_x * s_w + bias, the product exact and the scaling in fp32
    (``sdkiln::fp8_linear``).
    """

    scheme = "FP8_DYNAMIC"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.float32, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize each output channel as ``fp8_quantize_per_token`` quantizes a token (an all-zero
        channel gets scale 1)."""
        weight = linear.weight.detach()
        mod = cls(
            linear.in_features, linear.out_features, linear.bias is not None, weight.dtype, weight.device
        )
        mod.weight, mod.weight_scale = kernels.fp8_quantize_per_token(weight)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        return mod

    def params(self) -> dict:
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = kernels.fp8_quantize_per_token(x)
        return kernels.fp8_linear(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"
