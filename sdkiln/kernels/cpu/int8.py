"""The int8 linears on the CPU, on whichever exact int8 product the processor runs fast.

``torch._int_mm`` (oneDNN's int8 GEMM) is 3.5-4.6x faster than an fp32 matmul where the CPU has
VNNI and 35-57x slower on an AMD EPYC with AVX2 only; the exact fp32-chunk product runs at about
fp32 speed everywhere, and so does sdkiln's own AVX2 product (``native``, where it could be built:
``sdkiln.kernels.cpu.native``). ``cpu_profile().int8_product`` says which one this machine takes
(measured once, cached; see ``sdkiln.kernels.cpu_profile``), and each kernel's ``supports`` asks
it, so the dispatcher runs a product only where it is the fastest. All are exact, so the results
are the reference's bit for bit whichever runs.

The composites ``w8a8_linear_from_float`` and ``w8a8_static_linear_from_float`` (what the W8A8
modules call) get ``fused_<product>`` kernels: the activation quantization and the dequantization
in C around the chosen product, one Python call instead of about a dozen torch ops (the fixed cost
that made 16-token layers 2.4-6.3x slower than their fp32 Linear); with the native product the
whole linear is one C call.

For K <= 1024 the fp32 product is one fp32 matmul whose integer results are exact, used as they
are: the int32 round trip costs as much as the matmul at the embedded model's shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels import cpu_profile as profile
from sdkiln.kernels.cpu import native
from sdkiln.kernels.ops.int8 import (
    FP32_EXACT_CHUNK,
    W8A8_MAX_K,
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


def _product_for(x: Tensor, weight: Tensor) -> str:
    """The product the CPU profile chooses for x's rows times this weight (by the work's size)."""
    prof = profile.cpu_profile()
    if x.dim() == 0 or weight.dim() != 2:
        return prof.int8_product  # malformed: the kernel's checks raise the error
    k = x.shape[-1]
    return prof.int8_product_for(x.numel() // k if k else 0, k, weight.shape[0])


def _linear_prefers(product: str):
    def supports(x_q, x_scale, weight, *rest) -> bool:
        return _product_for(x_q, weight) == product and (product != "native" or native.available())

    return supports


def _static_prefers(product: str):
    def supports(x_q, weight, *rest) -> bool:
        return _product_for(x_q, weight) == product and (product != "native" or native.available())

    return supports


@register_kernel("w8a8_linear", "cpu", name="int_mm", priority=20, supports=_linear_prefers("int_mm"))
def w8a8_linear_int_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    return w8a8_linear_with(_int_mm_product, x_q, x_scale, weight, weight_scale, bias, out_dtype)


@register_kernel("w8a8_linear", "cpu", name="fp32_chunks", priority=10)
def w8a8_linear_fp32_chunks(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    return w8a8_linear_with(_fp32_product, x_q, x_scale, weight, weight_scale, bias, out_dtype)


@register_kernel("w8a8_static_linear", "cpu", name="int_mm", priority=20, supports=_static_prefers("int_mm"))
def w8a8_static_linear_int_mm(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    return w8a8_static_linear_with(_int_mm_product, x_q, weight, deq_scale, quant_bias, out_dtype)


@register_kernel("w8a8_static_linear", "cpu", name="fp32_chunks", priority=10)
def w8a8_static_linear_fp32_chunks(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    return w8a8_static_linear_with(_fp32_product, x_q, weight, deq_scale, quant_bias, out_dtype)


@register_kernel("w8a8_linear", "cpu", name="native", priority=20, supports=_linear_prefers("native"))
def w8a8_linear_native(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    return w8a8_linear_with(native.int8_product, x_q, x_scale, weight, weight_scale, bias, out_dtype)


@register_kernel("w8a8_static_linear", "cpu", name="native", priority=20, supports=_static_prefers("native"))
def w8a8_static_linear_native(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    return w8a8_static_linear_with(native.int8_product, x_q, weight, deq_scale, quant_bias, out_dtype)


# The fused composites. Their ``supports`` checks everything the C code relies on (the reference,
# which runs otherwise, raises the clear errors for bad arguments).

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_PRODUCTS = {"int_mm": _int_mm_product, "fp32_chunks": _fp32_product, "native": native.int8_product}


def _f32_vector(t: Tensor | None, n: int) -> bool:
    return t is None or (t.dtype == torch.float32 and t.numel() == n and t.is_contiguous())


def _fused_product_for(x: Tensor, weight: Tensor) -> str:
    """``fused_product_for`` of x's rows times the weight; asked by three kernels' ``supports`` per
    call of a layer that may take 15 us in all, so it stays a few attribute reads."""
    prof = profile.cpu_profile()
    if weight.dim() != 2 or x.numel() * weight.shape[0] >= prof.small_work:
        return prof.int8_product
    return prof.fused_product_small


def _native_linear_fits(x: Tensor, weight: Tensor) -> bool:
    return (
        x.dtype in _FLOATS
        and x.dim() >= 1
        and weight.dtype == torch.int8
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and 0 < weight.shape[1] <= W8A8_MAX_K
        and native.available()
    )


def _dynamic_fits(product: str):
    def supports(x, weight, weight_scale, bias) -> bool:
        if _fused_product_for(x, weight) != product or not _native_linear_fits(x, weight):
            return False
        n = weight.shape[0]
        return _f32_vector(weight_scale, n) and _f32_vector(bias, n)

    return supports


def _static_fits(product: str):
    def supports(x, input_scale, input_offset, weight, deq_scale, quant_bias) -> bool:
        if _fused_product_for(x, weight) != product or not _native_linear_fits(x, weight):
            return False
        n = weight.shape[0]
        return (
            input_scale.dtype == input_offset.dtype == torch.float32
            and input_scale.numel() == input_offset.numel() == 1
            and _f32_vector(deq_scale, n)
            and quant_bias.dtype == torch.int32
            and quant_bias.numel() == n
            and quant_bias.is_contiguous()
        )

    return supports


def _shaped(y: Tensor, x: Tensor) -> Tensor:
    """y (fp32, [M, N] or already [..., N]) as the reference returns it: x's dtype and leading shape."""
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if y.dim() == x.dim() else y.view(*x.shape[:-1], y.shape[-1])


def fused_dynamic(product: str):
    """The fused ``w8a8_linear_from_float`` kernel on ``product`` (the CPU profile times each)."""

    def kernel(x, weight, weight_scale, bias) -> Tensor:
        if product == "native":
            return _shaped(native.w8a8_dynamic(x, weight, weight_scale, bias), x)
        x_q, x_scale = native.quant_per_token(x)
        acc = _PRODUCTS[product](x_q, weight).to(torch.int32)
        return _shaped(native.dequant_per_token(acc, x_scale, weight_scale, bias), x)

    return kernel


def _fused_static(product: str):
    def kernel(x, input_scale, input_offset, weight, deq_scale, quant_bias) -> Tensor:
        if product == "native":
            return _shaped(native.w8a8_static(x, input_scale, input_offset, weight, quant_bias, deq_scale), x)
        x_q = native.quant_per_tensor(x, float(input_scale), float(input_offset))
        acc = _PRODUCTS[product](x_q, weight).to(torch.int32)
        return _shaped(native.dequant_per_tensor(acc, quant_bias, deq_scale), x)

    return kernel


# Native first: it is what the small calls take, where one ``supports`` call is a tenth of the time.
for _product in ("native", "int_mm", "fp32_chunks"):
    register_kernel(
        "w8a8_linear_from_float",
        "cpu",
        name=f"fused_{_product}",
        priority=20,
        supports=_dynamic_fits(_product),
    )(fused_dynamic(_product))
    register_kernel(
        "w8a8_static_linear_from_float",
        "cpu",
        name=f"fused_{_product}",
        priority=20,
        supports=_static_fits(_product),
    )(_fused_static(_product))
