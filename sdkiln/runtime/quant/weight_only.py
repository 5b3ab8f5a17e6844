"""W8A16 and W4A16 at run time: quantized weights, activations stay in the model's float dtype.

Both store symmetric weights with the Ascend/msModelSlim names ``weight``, ``weight_scale``,
``weight_offset`` (zeros) and ``bias``, and run ``sdkiln::weight_only_linear``. W4A16 stores its
int4 values packed two per byte (``sdkiln.kernels.int4``), so the package really is 4-bit; the
Ascend export unpacks them with ``unpack_int4``.
"""

from __future__ import annotations

import torch
from torch import nn

from sdkiln import kernels
from sdkiln.kernels.int4 import pack_int4
from sdkiln.runtime.quant import QuantLinear
from sdkiln.runtime.quant.w8a8_dynamic import INT8_WEIGHT_RANGE, int8_weight

# W4A16 values lie in [-7, 7]: symmetric around a zero offset, as the Ascend format's zero
# weight_offset says. The storage format and the op also decode -8, so other producers may use it.
INT4_QMAX = 7


def _symmetric(groups: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values in [-qmax, qmax] and fp32 scales (``absmax / qmax``, 1 for an all-zero group) of
    ``groups`` [..., G]: ``round(w / scale)`` half to even."""
    scale = groups.abs().amax(dim=-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(groups / scale.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    return values, scale


class _WeightOnlyLinear(QuantLinear):
    group_size = 0
    quantizes_activations = False

    def _init_common(
        self, in_features: int, out_features: int, bias: bool, dtype, device, groups: int
    ) -> None:
        self.register_buffer(
            "weight_scale", torch.empty(out_features, groups, dtype=torch.float32, device=device)
        )
        self.register_buffer(
            "weight_offset", torch.empty(out_features, groups, dtype=torch.float32, device=device)
        )
        self._init_linear(in_features, out_features, bias, dtype, device)

    def _fill(self, linear: nn.Linear, weight: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight.copy_(weight)
        self.weight_scale.copy_(scale)
        self.weight_offset.zero_()
        if linear.bias is not None:
            self.bias.copy_(linear.bias.detach())

    def set_values(self, values: torch.Tensor) -> None:
        self.weight.copy_(values.to(torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.weight_only_linear(x, self.weight, self.weight_scale, self.bias, self.group_size)


class W8A16Linear(_WeightOnlyLinear):
    """int8 per-channel symmetric weight (``int8_weight``: ``absmax / 127.5``, values in [-128, 127]);
    float activations (W8A16).

    y = x @ (Wq * s_w)^T + bias, in fp32, rounded to x's dtype.
    """

    scheme = "W8A16"
    recipe_kind = "w8a16"
    weight_range = INT8_WEIGHT_RANGE
    ascend_rank = 1
    torchao_config = "Int8WeightOnlyConfig"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=torch.float32, device=None):
        super().__init__()
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        )
        self._init_common(in_features, out_features, bias, dtype, device, groups=1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges=None) -> W8A16Linear:
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        values, scale = int8_weight(w)
        mod._fill(linear, values, scale)
        return mod


class W4A16Linear(_WeightOnlyLinear):
    """int4 group-wise symmetric weight: one scale (``absmax / 7``) per ``group_size`` consecutive
    inputs of an output channel, values in [-7, 7] packed two per byte (W4A16).

    ``weight`` is uint8 [N, K/2], ``weight_scale`` and ``weight_offset`` (zeros) fp32 [N, K/G].
    """

    scheme = "W4A16"
    recipe_kind = "w4a16"
    weight_range = (-INT4_QMAX, INT4_QMAX)
    ascend_refusal = (
        "this W4A16 is group-wise (one scale per 64 or 128 inputs) and MindIE SD's weight-only layer "
        "calls npu_weight_quant_batchmatmul without antiquant_group_size, which CANN takes only for "
        "per-channel scales; export w8a16 for Ascend instead"
    )

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype=torch.float32,
        device=None,
        *,
        group_size: int,
    ):
        super().__init__()
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 2 or in_features % group_size:
            raise ValueError(
                f"W4A16: group_size must be a positive even divisor of in_features={in_features}, got {group_size!r}"
            )
        self.group_size = group_size
        self.register_buffer(
            "weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self._init_common(in_features, out_features, bias, dtype, device, groups=in_features // group_size)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranges=None, *, group_size: int) -> W4A16Linear:
        if linear.in_features % group_size:
            raise ValueError(f"in_features {linear.in_features} is not a multiple of group_size {group_size}")
        w = linear.weight.detach()
        mod = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            w.dtype,
            w.device,
            group_size=group_size,
        )
        groups = w.float().reshape(linear.out_features, -1, group_size)
        values, scale = _symmetric(groups, INT4_QMAX)
        mod._fill(linear, pack_int4(values.reshape(linear.out_features, linear.in_features)), scale)
        return mod

    def set_values(self, values: torch.Tensor) -> None:
        if values.abs().max() > INT4_QMAX:
            raise ValueError(f"W4A16 values must lie in [-{INT4_QMAX}, {INT4_QMAX}]")
        self.weight.copy_(pack_int4(values.to(torch.int8)))

    def params(self) -> dict:
        return {"group_size": self.group_size}
