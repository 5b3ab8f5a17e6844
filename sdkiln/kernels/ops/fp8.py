"""float8 (e4m3fn) ops: per-token activation quantization and the fp8 x fp8 linear of FP8_DYNAMIC."""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import check_quantized_matmul, contiguous_as
from sdkiln.kernels.registry import define

# e4m3fn's largest finite value, and the largest K for which fp8_matmul's fp64 sum is exact.
FP8_E4M3_MAX = 448.0
FP8_MAX_K = 2**17


def fp8_quantize_per_token_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token float8: ``scale = absmax(x, -1) / 448``, ``q = e4m3fn(clamp(x / scale))``.

    Returns float8_e4m3fn values of x's shape and fp32 scales [..., 1]. In fp32: the scale is the
    absmax divided by 448 (e4m3fn's largest finite value); a row whose scale is 0 gets scale 1.0 and
    all-zero values. Values are ``x / scale`` (a true division) clamped to [-448, 448], then cast,
    which rounds to nearest even. The clamp comes first because e4m3fn has no infinity: the division
    can round to just above 448, and an overflowing cast gives NaN on some devices.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for float8_e4m3fn a [M, K] and b [N, K], as float64.

    Every e4m3fn value is a multiple of 2**-9 below 2**9 in magnitude, so a product is a multiple of
    2**-18 below 2**18, and a sum of K <= 2**17 products is a multiple of 2**-18 below 2**35: at most
    53 significant bits, which fp64 holds exactly in any summation order. Devices without an fp64
    matmul (Ascend NPUs) need a kernel of their own for ``fp8_linear``.
    """
    return a.double() @ b.double().T


def check_fp8_linear(x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor) -> None:
    """Shape and dtype rules of ``fp8_linear``; shared with its fake."""
    check_quantized_matmul(
        "fp8_linear",
        x_q,
        weight,
        FP8_MAX_K,
        "the fp64 accumulation is no longer exact",
        [
            ("x_q", x_q, torch.float8_e4m3fn),
            ("weight", weight, torch.float8_e4m3fn),
            ("x_scale", x_scale, torch.float32),
            ("weight_scale", weight_scale, torch.float32),
        ],
    )
    if tuple(x_scale.shape) != (*x_q.shape[:-1], 1):
        raise ValueError(f"fp8_linear: x_scale must be [..., 1] of x_q's rows, got {tuple(x_scale.shape)}")
    if tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise ValueError(f"fp8_linear: weight_scale must be [N, 1], got {tuple(weight_scale.shape)}")


def fp8_linear_reference(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """float8_e4m3fn activations [..., K] times float8_e4m3fn weight [N, K]: [..., N] in out_dtype.

    ``acc = x_q @ weight.T`` is exact (``fp8_matmul``, K <= 2**17) and rounded once to fp32. Then,
    in fp32 and in this order: ``y = (acc * x_scale) * weight_scale.T``, ``y = y + float(bias)``,
    and one rounding to out_dtype, as ``w8a8_linear``. A fused kernel matches this to within its
    accumulation's precision (``sdkiln.kernels.cuda.scaled_mm``: Hopper's fp8 tensor cores
    accumulate with fewer bits than fp32).
    """
    check_fp8_linear(x_q, x_scale, weight, weight_scale)
    lead = x_q.shape[:-1]
    y = fp8_matmul(x_q.reshape(-1, x_q.shape[-1]), weight).float() * x_scale.reshape(-1, 1)
    y = y * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return contiguous_as(y, out_dtype).reshape(*lead, weight.shape[0])


def _fake_fp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    scale = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), scale


def _fake_fp8_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    check_fp8_linear(x_q, x_scale, weight, weight_scale)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


define(
    "fp8_quantize_per_token(Tensor x) -> (Tensor, Tensor)",
    reference=fp8_quantize_per_token_reference,
    fake=_fake_fp8_quantize,
    differentiable=False,
)
define(
    "fp8_linear(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor",
    reference=fp8_linear_reference,
    fake=_fake_fp8_linear,
    differentiable=False,
)


def fp8_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token float8_e4m3fn quantization: (fp8 values like x, fp32 scales [..., 1])."""
    return torch.ops.sdkiln.fp8_quantize_per_token.default(x)


def fp8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """float8 x float8 linear, exact product, dequantized per token and per channel: [..., N]."""
    return torch.ops.sdkiln.fp8_linear.default(x_q, x_scale, weight, weight_scale, bias, out_dtype)
