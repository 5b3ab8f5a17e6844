"""Elementwise kernels: ``gelu_tanh``, ``mul_add`` (gate-and-residual), ``rope`` (both rotation
conventions) and ``quantize_per_tensor_int8`` (W8A8's static activation quantization).

Each computes in fp32 after loading and rounds once when storing, as the references do. Operands
that broadcast are passed as rows with a row divisor (``rows.modulation_rows``): a FLUX gate
[B, 1, D] or a RoPE table [S, D] is read where it lies, not expanded to x's size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.int8 import check_quantize_per_tensor_int8
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.configs import KERNEL_NAME, MAX_ROW, row_warps
from sdkiln.kernels.triton.rounding import rounded
from sdkiln.kernels.triton.rows import FLOATS, modulation_rows

FLAT_BLOCK = 1024


@triton.jit
def _gelu_tanh(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tanh = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
    tl.store(y_ptr + offs, rounded(0.5 * x * (1.0 + tanh), y_ptr.dtype.element_ty), mask=inside)


@triton_op("sdkiln_triton::gelu_tanh", mutates_args=())
def gelu_tanh(x: Tensor) -> Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        wrap_triton(_gelu_tanh)[(triton.cdiv(n, FLAT_BLOCK),)](xc, y, n, BLOCK=FLAT_BLOCK)
    return y


@triton.jit
def _mul_add(x_ptr, y_ptr, z_ptr, out_ptr, D, x_div, y_div, z_div, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x = tl.load(x_ptr + (row // x_div) * D + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + (row // y_div) * D + cols, mask=inside, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (row // z_div) * D + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, rounded(x * y + z, out_ptr.dtype.element_ty), mask=inside)


@triton_op("sdkiln_triton::mul_add", mutates_args=())
def mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    shape = torch.broadcast_shapes(x.shape, y.shape, z.shape)
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    d = shape[-1]
    operands = [modulation_rows(t, out, samples=False) for t in (x, y, z)]
    rows = out.numel() // d if d else 0
    block = triton.next_power_of_2(max(d, 1))
    if rows:
        wrap_triton(_mul_add)[(rows,)](
            *(t for t, _ in operands), out, d, *(div for _, div in operands),
            BLOCK=block, num_warps=row_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return out


@triton.jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, y_ptr, D, size1, size2, stride0, stride1, stride2,
    INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    i2 = row % size2
    i1 = (row // size2) % size1
    i0 = row // (size2 * size1)
    table = i0 * stride0 + i1 * stride1 + i2 * stride2
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half = D // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    other = tl.load(x_ptr + row * D + partner, mask=inside, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + table + cols, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, rounded(x * c + (sign * other) * s, y_ptr.dtype.element_ty), mask=inside)


def _table(t: Tensor, x: Tensor) -> Tensor:
    """cos or sin expanded (a view) to x's shape, as 4-D [d0, d1, d2, D] with unit last stride."""
    t = t.expand(x.shape)
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
    return t if t.stride(-1) == 1 else t.contiguous()


@triton_op("sdkiln_triton::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    cos4, sin4 = _table(cos, xc), _table(sin, xc)
    if cos4.stride() != sin4.stride():
        cos4, sin4 = cos4.contiguous(), sin4.contiguous()
    d = xc.shape[-1]
    rows = xc.numel() // d if d else 0
    block = triton.next_power_of_2(max(d, 1))
    if rows:
        wrap_triton(_rope)[(rows,)](
            xc, cos4, sin4, y, d, cos4.shape[1], cos4.shape[2], *cos4.stride()[:3],
            INTERLEAVED=interleaved, BLOCK=block, num_warps=row_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return y


@triton.jit
def _quantize_per_tensor(x_ptr, scale_ptr, offset_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    v = tl.math.div_rn(x, tl.load(scale_ptr)) + tl.load(offset_ptr)
    v = tl.minimum(tl.maximum((v + 12582912.0) - 12582912.0, -128.0), 127.0)
    tl.store(y_ptr + offs, v.to(tl.int8), mask=inside)


@triton_op("sdkiln_triton::quantize_per_tensor_int8", mutates_args=())
def quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    check_quantize_per_tensor_int8(x, scale, offset)
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=torch.int8, device=x.device)
    n = xc.numel()
    if n:
        wrap_triton(_quantize_per_tensor)[(triton.cdiv(n, FLAT_BLOCK),)](
            xc, scale.reshape(1), offset.reshape(1), y, n, BLOCK=FLAT_BLOCK
        )
    return y


def _rope_fits(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> bool:
    d = x.shape[-1]
    return x.dtype in FLOATS and x.dim() <= 4 and 0 < d <= MAX_ROW and d % 2 == 0


register_kernel("gelu_tanh", "cuda", KERNEL_NAME, supports=lambda x: x.dtype in FLOATS)(gelu_tanh)
register_kernel(
    "mul_add",
    "cuda",
    KERNEL_NAME,
    supports=lambda x, y, z: (
        all(t.dtype in FLOATS for t in (x, y, z))
        and 0 < torch.broadcast_shapes(x.shape, y.shape, z.shape)[-1] <= MAX_ROW
    ),
)(mul_add)
register_kernel("rope", "cuda", KERNEL_NAME, supports=_rope_fits)(rope)
register_kernel("quantize_per_tensor_int8", "cuda", KERNEL_NAME, supports=lambda x, s, o: x.dtype in FLOATS)(
    quantize_per_tensor_int8
)
