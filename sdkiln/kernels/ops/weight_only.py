"""The weight-only linear of W8A16 and W4A16: float activations times int8 or packed int4 weights."""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.int4 import unpack_int4
from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.registry import define


def check_weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, group_size: int) -> None:
    """Shape and dtype rules of ``weight_only_linear``; shared with its fake."""
    k = x.shape[-1]
    if not x.is_floating_point():
        raise ValueError(f"weight_only_linear: x must be a float tensor, got {x.dtype}")
    if weight.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"weight_only_linear: weight must be torch.int8 (one value a byte) or torch.uint8 (two int4 "
            f"values a byte), got {weight.dtype}"
        )
    packed = weight.dtype == torch.uint8
    if weight.dim() != 2 or weight.shape[1] != (k // 2 if packed else k) or (packed and k % 2):
        raise ValueError(
            f"weight_only_linear: a {weight.dtype} weight must be [N, {'K/2' if packed else 'K'}] with "
            f"K = x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if group_size < 0 or (group_size and k % group_size):
        raise ValueError(
            f"weight_only_linear: group_size must be 0 (per channel) or divide K={k}, got {group_size}"
        )
    groups = k // group_size if group_size else 1
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0], groups):
        raise ValueError(
            f"weight_only_linear: weight_scale must be float32 [N, {groups}] for group_size {group_size}, got "
            f"{weight_scale.dtype} {tuple(weight_scale.shape)}"
        )


def dequantize_weight(weight: Tensor, weight_scale: Tensor, group_size: int) -> Tensor:
    """fp32 [N, K] from int8 [N, K] or packed int4 uint8 [N, K/2] values and their scales.

    ``w = float(v) * scale`` per element, one correctly rounded product; ``group_size`` 0 means one
    scale per row ([N, 1]), otherwise scale ``[n, g]`` covers columns ``g*G`` to ``(g+1)*G - 1``.
    """
    values = (unpack_int4(weight) if weight.dtype == torch.uint8 else weight).float()
    n, k = values.shape
    if not group_size:
        return values * weight_scale
    return (values.reshape(n, k // group_size, group_size) * weight_scale.unsqueeze(-1)).reshape(n, k)


def weight_only_linear_reference(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    """Float activations [..., K] times a quantized weight: [..., N] in x's dtype (W8A16, W4A16).

    ``weight`` is int8 [N, K] or packed int4 uint8 [N, K/2] (``sdkiln.kernels.int4``); scales are
    per channel (``group_size`` 0, [N, 1]) or per group of ``group_size`` along K ([N, K/G]).
    In fp32: ``w = dequantize_weight(...)`` (exact up to one rounding per element),
    ``y = float(x) @ w.T`` (an fp32 matmul: as exact as the device's, not bit-reproducible across
    devices or batch shapes), ``y = y + float(bias)``, then one rounding to x's dtype. Kernels that
    dequantize in bf16/fp16 (torch_npu's ``npu_weight_quant_batchmatmul``) match it to that precision.
    """
    check_weight_only_linear(x, weight, weight_scale, group_size)
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]).float() @ dequantize_weight(weight, weight_scale, group_size).T
    if bias is not None:
        y = y + bias.float()
    return contiguous_as(y, x.dtype).reshape(*lead, weight.shape[0])


def _fake_weight_only_linear(x, weight, weight_scale, bias, group_size) -> Tensor:
    check_weight_only_linear(x, weight, weight_scale, group_size)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define(
    "weight_only_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int group_size) -> Tensor",
    reference=weight_only_linear_reference,
    fake=_fake_weight_only_linear,
    differentiable=False,
)


def weight_only_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None, group_size: int = 0
) -> Tensor:
    """Float x [..., K] times int8 [N, K] or packed int4 [N, K/2] weights, per channel (``group_size``
    0) or per group along K: [..., N] in x's dtype."""
    return torch.ops.sdkiln.weight_only_linear.default(x, weight, weight_scale, bias, group_size)
