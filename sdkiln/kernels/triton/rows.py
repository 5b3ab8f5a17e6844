"""Row kernels: one program per row of the last axis, the row held in registers.

One Triton kernel, ``_rows``, specialized at compile time by what it does to a row: normalize it
(RMSNorm, or LayerNorm without affine), scale it by a weight, modulate it (adaLN's
``* (1 + scale) + shift`` with one modulation row per sample), and quantize it per token to int8
or float8_e4m3fn. It serves ``rms_norm``, ``layer_norm_modulate``, ``quantize_per_token_int8``,
``fp8_quantize_per_token`` and the fused ``rms_norm_quantize`` / ``layer_norm_modulate_quantize``,
which read the activation once and write only the quantized values and their scales.

Quantization follows the reference exactly: the normalized row is first rounded to x's dtype (as
the unfused norm's output is), ``scale = absmax / qmax`` and ``x / scale`` are correctly rounded
divisions (``div_rn``), int8 rounds half to even (adding and subtracting 1.5 * 2**23, exact for
|v| < 2**22) and float8 values are clamped to +-448 before the round-to-nearest-even cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.fused import QUANTIZERS
from sdkiln.kernels.ops.norm import per_sample
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.configs import KERNEL_NAME, MAX_ROW, row_warps
from sdkiln.kernels.triton.rounding import fp8_bits, fp8_rne, rounded

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2
QUANT_OF = {torch.int8: QUANT_INT8, torch.float8_e4m3fn: QUANT_FP8}


@triton.jit
def _rows(
    x_ptr, w_ptr, scale_ptr, shift_ptr, y_ptr, s_ptr,
    D, rows_per_group, eps,
    NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, MODULATE: tl.constexpr, QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    if NORM == 1:
        ms = tl.sum(x * x, axis=0) / D
        x = x * tl.math.rsqrt(ms + eps)
    if NORM == 2:
        mean = tl.sum(x, axis=0) / D
        centered = tl.where(inside, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / D
        x = centered * tl.math.rsqrt(var + eps)
    if HAS_WEIGHT:
        x = x * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if MODULATE:
        group = row // rows_per_group
        scale = tl.load(scale_ptr + group * D + cols, mask=inside, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + group * D + cols, mask=inside, other=0.0).to(tl.float32)
        x = x * (1.0 + scale) + shift
    if QUANT == 0:
        tl.store(y_ptr + row * D + cols, rounded(x, y_ptr.dtype.element_ty), mask=inside)
    else:
        if NORM != 0 or MODULATE:
            x = rounded(x, x_ptr.dtype.element_ty).to(tl.float32)  # the unfused norm's rounding
        absmax = tl.max(tl.where(inside, tl.abs(x), 0.0), axis=0)
        if QUANT == 1:
            s = tl.math.div_rn(absmax, 127.0)
        else:
            s = tl.math.div_rn(absmax, 448.0)
        s = tl.where(s > 0, s, 1.0)
        v = tl.math.div_rn(x, s)
        if QUANT == 1:
            v = tl.minimum(tl.maximum((v + 12582912.0) - 12582912.0, -127.0), 127.0)
            tl.store(y_ptr + row * D + cols, v.to(tl.int8), mask=inside)
        else:
            v = fp8_rne(tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0)))
            tl.store(y_ptr + row * D + cols, fp8_bits(v), mask=inside)  # y_ptr: a uint8 view
        tl.store(s_ptr + row, s)


def modulation_rows(mod: Tensor, x: Tensor, full: bool = False, samples: bool = True) -> tuple[Tensor, int]:
    """A modulation broadcasting against x [..., D] as (rows [G, D] contiguous, rows of x per row):
    one row per sample ([B, 1, D], or [B, D] under adaLN's rule, ``samples``) or one for all keeps
    its size; any other broadcast, or ``full``, is expanded to one row per token. Without
    ``samples`` a 2-D operand broadcasts as torch broadcasts ([S, D] is [1, S, D])."""
    d = x.shape[-1]
    mod = per_sample(mod, x) if samples else mod
    mod = mod.reshape((1,) * (x.dim() - mod.dim()) + tuple(mod.shape))
    mod = mod.expand(*mod.shape[:-1], d)
    if not full and all(size == 1 for size in mod.shape[1:-1]) and mod.shape[0] in (1, x.shape[0]):
        groups = mod.shape[0]
        return mod.reshape(groups, d).contiguous(), x.numel() // d // groups
    return mod.expand(x.shape).reshape(-1, d).contiguous(), 1


def _launch(x: Tensor, weight, scale, shift, eps: float, norm: int, quant: int, out_dtype) -> tuple:
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    modulate = scale is not None
    scale_rows, shift_rows, per_group = x2, x2, 1
    if modulate:
        (scale_rows, per_group), (shift_rows, shift_group) = (
            modulation_rows(scale, x),
            modulation_rows(shift, x),
        )
        if shift_group != per_group:
            (scale_rows, per_group), (shift_rows, _) = (
                modulation_rows(scale, x, True),
                modulation_rows(shift, x, True),
            )
    block = triton.next_power_of_2(d)
    if rows:
        wrap_triton(_rows)[(rows,)](
            x2, x2 if weight is None else weight.contiguous(), scale_rows, shift_rows,
            y.view(torch.uint8) if quant == QUANT_FP8 else y, s, d, per_group, eps,
            NORM=norm, HAS_WEIGHT=weight is not None, MODULATE=modulate, QUANT=quant,
            BLOCK=block, num_warps=row_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return y, s


def _row_fits(x: Tensor, *others: Tensor | None) -> bool:
    return (
        x.dtype in FLOATS
        and 0 < x.shape[-1] <= MAX_ROW
        and all(t is None or t.dtype in FLOATS for t in others)
    )


@triton_op("sdkiln_triton::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return _launch(x, weight, None, None, eps, NORM_RMS, QUANT_NONE, x.dtype)[0]


@triton_op("sdkiln_triton::layer_norm_modulate", mutates_args=())
def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    return _launch(x, None, scale, shift, eps, NORM_LAYER, QUANT_NONE, x.dtype)[0]


@triton_op("sdkiln_triton::quantize_per_token", mutates_args=())
def quantize_per_token(x: Tensor, qdtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _launch(x, None, None, None, 0.0, NORM_NONE, QUANT_OF[qdtype], qdtype)


@triton_op("sdkiln_triton::rms_norm_quantize", mutates_args=())
def rms_norm_quantize(
    x: Tensor, weight: Tensor | None, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    return _launch(x, weight, None, None, eps, NORM_RMS, QUANT_OF[qdtype], qdtype)


@triton_op("sdkiln_triton::layer_norm_modulate_quantize", mutates_args=())
def layer_norm_modulate_quantize(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    return _launch(x, None, scale, shift, eps, NORM_LAYER, QUANT_OF[qdtype], qdtype)


def _weight_fits(x: Tensor, weight: Tensor | None) -> bool:
    return weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1])


register_kernel(
    "rms_norm", "cuda", KERNEL_NAME, supports=lambda x, w, eps: _row_fits(x, w) and _weight_fits(x, w)
)(rms_norm)
register_kernel(
    "layer_norm_modulate", "cuda", KERNEL_NAME, supports=lambda x, sc, sh, eps: _row_fits(x, sc, sh)
)(layer_norm_modulate)
register_kernel("quantize_per_token_int8", "cuda", KERNEL_NAME, supports=_row_fits)(
    lambda x: quantize_per_token(x, torch.int8)
)
register_kernel("fp8_quantize_per_token", "cuda", KERNEL_NAME, supports=_row_fits)(
    lambda x: quantize_per_token(x, torch.float8_e4m3fn)
)
register_kernel(
    "rms_norm_quantize",
    "cuda",
    KERNEL_NAME,
    supports=lambda x, w, eps, q: q in QUANTIZERS and _row_fits(x, w) and _weight_fits(x, w),
)(rms_norm_quantize)
register_kernel(
    "layer_norm_modulate_quantize",
    "cuda",
    KERNEL_NAME,
    supports=lambda x, sc, sh, eps, q: q in QUANTIZERS and _row_fits(x, sc, sh),
)(layer_norm_modulate_quantize)
