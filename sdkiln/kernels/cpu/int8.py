"""The int8 linears on the CPU, on whichever exact int8 product the processor runs fast.

``torch._int_mm`` (oneDNN's int8 GEMM) is 3.5-4.6x faster than an fp32 matmul where the CPU has
VNNI and 35-57x slower on an AMD EPYC with AVX2 only; the exact fp32-chunk product runs at about
fp32 speed everywhere. ``cpu_profile().int8_product`` says which one this machine takes (measured
once, cached; see ``sdkiln.kernels.cpu_profile``), and each kernel's ``supports`` asks it, so the
dispatcher runs ``int_mm`` only where it is the faster one. Both are exact, so the results are the
reference's bit for bit whichever runs.

For K <= 1024 the fp32 product is one fp32 matmul whose integer results are exact, used as they
are: the int32 round trip costs as much as the matmul at the embedded model's shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels import cpu_profile as profile
from sdkiln.kernels.ops.int8 import (
    FP32_EXACT_CHUNK,
    int8_matmul_fp32_chunks,
    w8a8_linear_with,
    w8a8_static_linear_with,
)
from sdkiln.kernels.registry import register_kernel


def _fp32_product(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T``: one fp32 matmul (float result) up to ``FP32_EXACT_CHUNK`` terms, else
    the chunked product (int32)."""
    if a.shape[1] <= FP32_EXACT_CHUNK:
        return a.float() @ b.float().T
    return int8_matmul_fp32_chunks(a, b)


def _int_mm_product(a: Tensor, b: Tensor) -> Tensor:
    return torch._int_mm(a, b.T)


def _prefers_int_mm(*args) -> bool:
    return profile.cpu_profile().int8_product == "int_mm"


@register_kernel("w8a8_linear", "cpu", name="int_mm", priority=20, supports=_prefers_int_mm)
def w8a8_linear_int_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    return w8a8_linear_with(_int_mm_product, x_q, x_scale, weight, weight_scale, bias, out_dtype)


@register_kernel("w8a8_linear", "cpu", name="fp32_chunks", priority=10)
def w8a8_linear_fp32_chunks(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    return w8a8_linear_with(_fp32_product, x_q, x_scale, weight, weight_scale, bias, out_dtype)


@register_kernel("w8a8_static_linear", "cpu", name="int_mm", priority=20, supports=_prefers_int_mm)
def w8a8_static_linear_int_mm(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    return w8a8_static_linear_with(_int_mm_product, x_q, weight, deq_scale, quant_bias, out_dtype)


@register_kernel("w8a8_static_linear", "cpu", name="fp32_chunks", priority=10)
def w8a8_static_linear_fp32_chunks(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    return w8a8_static_linear_with(_fp32_product, x_q, weight, deq_scale, quant_bias, out_dtype)
