"""``fp8_linear`` on NVIDIA GPUs with fp8 tensor cores: ``torch._scaled_mm`` with row-wise scales.

The product runs on the fp8 tensor cores with per-token (activation) and per-channel (weight)
scales applied in the GEMM epilogue, the bias added there in fp32 and the result rounded once to
the output dtype: the reference's order of operations. What differs is the accumulation: Hopper's
fp8 matrix instructions accumulate with fewer than fp32's bits, so the result matches the reference
to within that (``tests/kernels/test_fp8_weight_only_ops.py`` states the tolerance), not bit for bit.

``supports_scaled_mm`` admits what cuBLASLt's row-wise fp8 path takes: a device of compute
capability 8.9 or newer (Ada, Hopper), K and N multiples of 16, bfloat16 output (the row-wise
epilogue writes bfloat16) and a bfloat16 bias or none. Anything else runs the next kernel or the
reference.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from sdkiln.kernels.ops.fp8 import check_fp8_linear
from sdkiln.kernels.registry import register_kernel

FP8_MIN_CAPABILITY = (8, 9)
ALIGNMENT = 16


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def supports_scaled_mm(
    x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, out_dtype
) -> bool:
    if x_q.device.type != "cuda" or _capability(x_q.device.index or 0) < FP8_MIN_CAPABILITY:
        return False
    n, k = weight.shape
    return (
        out_dtype == torch.bfloat16
        and k % ALIGNMENT == 0
        and n % ALIGNMENT == 0
        and (bias is None or bias.dtype == torch.bfloat16)
    )


@register_kernel("fp8_linear", "cuda", name="scaled_mm", priority=10, supports=supports_scaled_mm)
def fp8_linear_scaled_mm(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``(x_q @ weight.T) * x_scale * weight_scale.T + bias`` on the fp8 tensor cores. The weight
    [N, K] row-major goes in as its transposed view, the column-major [K, N] that ``_scaled_mm``
    wants; no copy is made."""
    check_fp8_linear(x_q, x_scale, weight, weight_scale)
    lead, k = x_q.shape[:-1], x_q.shape[-1]
    y = torch._scaled_mm(
        x_q.reshape(-1, k),
        weight.t(),
        scale_a=x_scale.reshape(-1, 1),
        scale_b=weight_scale.reshape(1, -1),
        bias=bias,
        out_dtype=out_dtype,
    )
    return y.reshape(*lead, weight.shape[0])
