"""The quantized linears: ``w8a8_linear``, ``w8a8_static_linear``, ``fp8_linear`` and
``weight_only_linear`` (int8 and packed int4).

One tiled GEMM kernel, ``_qgemm``, specialized at compile time by its operands and epilogue:

* int8 x int8 (``tl.dot`` accumulating exactly in int32); the epilogue is W8A8_DYNAMIC's
  ``(float(acc) * x_scale) * w_scale + bias`` or W8A8's ``float(acc + quant_bias) * deq_scale``, in
  the reference's order, each step a correctly rounded fp32 operation (the kernels launch with
  ``enable_fp_fusion=False`` so no multiply-add is contracted), so the result is bit-exact;
* float8_e4m3fn x float8_e4m3fn, accumulated in fp32 by the tensor cores (Ada/Hopper), the same
  epilogue as W8A8_DYNAMIC; ``torch._scaled_mm`` (``sdkiln.kernels.cuda.scaled_mm``) stays the
  higher-priority kernel where it takes the shape;
* float x int8/int4 weight, dequantized tile by tile in registers (``w = float(v) * scale``, scale
  per channel or per group along K) and multiplied in the activation's dtype, for small M (decode-
  like batches, where the GEMM is bound by reading the weight). For large M a fused W4A16/W8A16
  GEMM loses to dequantizing once and running the dense GEMM (compute-bound; Marlin's and
  torchao's published curves cross near M = 64-128), so there the weight is dequantized by a
  Triton kernel and the product is ``torch.matmul``.

The weight is [N, K] row-major, read as its transpose tile by tile; tiles are visited in grouped
order (``GROUP_M``) for L2 reuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.fp8 import check_fp8_linear
from sdkiln.kernels.ops.int8 import check_w8a8_linear, check_w8a8_static_linear
from sdkiln.kernels.ops.weight_only import check_weight_only_linear
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.configs import INTERPRET, KERNEL_NAME, capability, gemm_configs
from sdkiln.kernels.triton.rounding import rounded
from sdkiln.kernels.triton.rows import FLOATS

EPI_DYNAMIC, EPI_STATIC, EPI_WEIGHT_ONLY = 0, 1, 2
W_PLAIN, W_INT4 = 0, 1
FUSED_WEIGHT_ONLY_MAX_M = 64
"""Above this many rows weight_only_linear dequantizes the weight and runs the dense GEMM."""
FP8_MIN_CAPABILITY = (8, 9)
INT8_MIN_CAPABILITY = (8, 0)


@triton.jit
def _qgemm(
    a_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, n_groups, M_BUCKET,
    EPILOGUE: tl.constexpr, W_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_in = rm < M
    n_in = rn < N
    if EPILOGUE == 2:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif not FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_in = ks < K
        a = tl.load(
            a_ptr + rm[:, None].to(tl.int64) * K + ks[None, :], mask=m_in[:, None] & k_in[None, :], other=0
        )
        if FP8:
            a = a.to(tl.float8e4nv, bitcast=True)
        if W_KIND == 1:
            byte = tl.load(
                w_ptr + rn[None, :].to(tl.int64) * (K // 2) + (ks[:, None] // 2),
                mask=n_in[None, :] & k_in[:, None],
                other=0,
            ).to(tl.int32)
            nibble = tl.where(ks[:, None] % 2 == 0, byte & 15, (byte >> 4) & 15)
            w = tl.where(nibble >= 8, nibble - 16, nibble)
        else:
            w = tl.load(
                w_ptr + rn[None, :].to(tl.int64) * K + ks[:, None],
                mask=n_in[None, :] & k_in[:, None],
                other=0,
            )
            if FP8:
                w = w.to(tl.float8e4nv, bitcast=True)
        if EPILOGUE == 2:
            g = ks[:, None] // group_size
            scale = tl.load(
                ws_ptr + rn[None, :] * n_groups + g, mask=n_in[None, :] & k_in[:, None], other=0.0
            )
            w = w.to(tl.float32) * scale
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a_ptr.dtype.element_ty))
        elif FP32_DOT and FP8:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif FP8:  # Hopper's fp8 MMA accumulates with fewer bits: promote to fp32 once per K tile
            acc += tl.dot(a, w, max_num_imprecise_acc=BLOCK_K)
        else:
            acc += tl.dot(a, w)
    if EPILOGUE == 0:
        y = acc.to(tl.float32) * tl.load(xs_ptr + rm, mask=m_in, other=0.0)[:, None]
        y = y * tl.load(ws_ptr + rn, mask=n_in, other=0.0)[None, :]
    elif EPILOGUE == 1:
        acc = acc + tl.load(bias_ptr + rn, mask=n_in, other=0)[None, :]
        y = acc.to(tl.float32) * tl.load(ws_ptr + rn, mask=n_in, other=0.0)[None, :]
    else:
        y = acc
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, rounded(y, out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


# Keyed on M's power-of-two bucket, not M: a new token count (resolution, prompt length) reuses the
# bucket's tuning instead of autotuning again.
_INT8_GEMM = triton.autotune(configs=gemm_configs("int8"), key=["M_BUCKET", "N", "K", "EPILOGUE"])(_qgemm)
_HALF_GEMM = triton.autotune(configs=gemm_configs("half"), key=["M_BUCKET", "N", "K", "W_KIND"])(_qgemm)


def _grid(m: int, n: int):
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def _run(kernel, a, w, xs, ws, bias, out, k, group_size, n_groups, epilogue, w_kind, has_bias) -> None:
    m, n = a.shape[0], out.shape[1]
    fp8 = a.dtype == torch.float8_e4m3fn
    if (
        fp8
    ):  # loaded as bytes and reinterpreted: no masked fp8 load to fill, no conversion of the interpreter's
        a, w = a.view(torch.uint8), w.view(torch.uint8)
    if m and n:
        wrap_triton(kernel)[_grid(m, n)](
            a, w, xs, ws, bias, out, m, n, k, group_size, n_groups, triton.next_power_of_2(m),
            EPILOGUE=epilogue, W_KIND=w_kind, HAS_BIAS=has_bias, FP32_DOT=INTERPRET or a.dtype == torch.float32, FP8=fp8,
            enable_fp_fusion=False,
        )  # fmt: skip


def _rows2d(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _scaled_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    a = _rows2d(x_q)
    out = torch.empty(a.shape[0], weight.shape[0], dtype=out_dtype, device=a.device)
    xs = x_scale.reshape(-1).contiguous()
    _run(_INT8_GEMM, a, weight.contiguous(), xs, weight_scale.reshape(-1).contiguous(),
         xs if bias is None else bias.contiguous(), out, a.shape[1], 0, 1, EPI_DYNAMIC, W_PLAIN, bias is not None)  # fmt: skip
    return out.reshape(*x_q.shape[:-1], weight.shape[0])


@triton_op("sdkiln_triton::w8a8_linear", mutates_args=())
def w8a8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    return _scaled_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype)


@triton_op("sdkiln_triton::fp8_linear", mutates_args=())
def fp8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    check_fp8_linear(x_q, x_scale, weight, weight_scale)
    return _scaled_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype)


@triton_op("sdkiln_triton::w8a8_static_linear", mutates_args=())
def w8a8_static_linear(
    x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor, out_dtype: torch.dtype
) -> Tensor:
    check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    a = _rows2d(x_q)
    out = torch.empty(a.shape[0], weight.shape[0], dtype=out_dtype, device=a.device)
    deq_scale = deq_scale.contiguous()
    _run(_INT8_GEMM, a, weight.contiguous(), deq_scale, deq_scale, quant_bias.contiguous(), out,
         a.shape[1], 0, 1, EPI_STATIC, W_PLAIN, False)  # fmt: skip
    return out.reshape(*x_q.shape[:-1], weight.shape[0])


@triton.jit
def _dequantize(w_ptr, ws_ptr, out_ptr, K, group_size, n_groups, W_KIND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k_in = ks < K
    if W_KIND == 1:
        byte = tl.load(w_ptr + row * (K // 2) + ks // 2, mask=k_in, other=0).to(tl.int32)
        nibble = tl.where(ks % 2 == 0, byte & 15, (byte >> 4) & 15)
        v = tl.where(nibble >= 8, nibble - 16, nibble)
    else:
        v = tl.load(w_ptr + row * K + ks, mask=k_in, other=0)
    g = ks // group_size
    scale = tl.load(ws_ptr + row * n_groups + g, mask=k_in, other=0.0)
    tl.store(out_ptr + row * K + ks, rounded(v.to(tl.float32) * scale, out_ptr.dtype.element_ty), mask=k_in)


DEQUANT_BLOCK = 1024


@triton_op("sdkiln_triton::weight_only_linear", mutates_args=())
def weight_only_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    check_weight_only_linear(x, weight, weight_scale, group_size)
    a = _rows2d(x)
    n = weight.shape[0]
    k = a.shape[1]
    w_kind = W_INT4 if weight.dtype == torch.uint8 else W_PLAIN
    scales = weight_scale.contiguous()
    group_size = group_size or k  # per channel: one group spanning K
    if a.shape[0] > FUSED_WEIGHT_ONLY_MAX_M:
        dense = torch.empty(n, k, dtype=x.dtype, device=x.device)
        if n and k:
            wrap_triton(_dequantize)[(n, triton.cdiv(k, DEQUANT_BLOCK))](
                weight.contiguous(),
                scales,
                dense,
                k,
                group_size,
                scales.shape[1],
                W_KIND=w_kind,
                BLOCK=DEQUANT_BLOCK,
            )
        y = torch.nn.functional.linear(a, dense, None if bias is None else bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], n)
    out = torch.empty(a.shape[0], n, dtype=x.dtype, device=a.device)
    _run(_HALF_GEMM, a, weight.contiguous(), scales, scales, a if bias is None else bias.contiguous(), out, k,
         group_size, scales.shape[1], EPI_WEIGHT_ONLY, w_kind, bias is not None)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def _fp8_fits(*args) -> bool:
    return INTERPRET or capability() >= FP8_MIN_CAPABILITY


def _int8_fits(*args) -> bool:
    """int8 tensor-core MMA (and bf16 outputs) need Ampere or newer."""
    return INTERPRET or capability() >= INT8_MIN_CAPABILITY


register_kernel("w8a8_linear", "cuda", KERNEL_NAME, supports=_int8_fits)(w8a8_linear)
register_kernel("w8a8_static_linear", "cuda", KERNEL_NAME, supports=_int8_fits)(w8a8_static_linear)
register_kernel("fp8_linear", "cuda", KERNEL_NAME, priority=5, supports=_fp8_fits)(fp8_linear)
register_kernel("weight_only_linear", "cuda", KERNEL_NAME, supports=lambda x, w, s, b, g: x.dtype in FLOATS)(
    weight_only_linear
)
