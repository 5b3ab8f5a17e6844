"""FP8_DYNAMIC at run time: float8_e4m3fn weights, activations cast to float8 per token on the fly.

Tensor names follow the Ascend/msModelSlim naming of the other schemes (``weight``,
``weight_scale``, ``bias``); the weight is symmetric, so no offset is stored.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.runtime.quant import QuantLinear


class FP8DynamicLinear(QuantLinear):
    """float8_e4m3fn per-channel weight (``scale = absmax / 448``); activations quantized per token
    to float8 at run time (FP8_DYNAMIC).

    y = (q(x) @ Wq^T) * s_x * s_w + bias, the product exact and the scaling in fp32
    (``sdkiln::fp8_linear``).
    """

    scheme = "FP8_DYNAMIC"
    recipe_kind = "fp8_dynamic"
    ascend_refusal = (
        "MindIE SD has no FP8 linear format: its FP8_DYNAMIC quantizes attention (fa_quant) and "
        "msModelSlim's WFP8AFP8_DYNAMIC is not a QuantAlgorithm MindIE SD reads; export an int8 "
        "or weight-only recipe for Ascend instead"
    )

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.float32, device=None):
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        self._init_linear(in_features, out_features, bias, dtype, device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges=None) -> FP8DynamicLinear:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = kernels.fp8_quantize_per_token(x)
        return kernels.fp8_linear(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)


FP8Linear = FP8DynamicLinear
"""The name before milestone 2; kept for code that imports it."""
