"""Quantized attention (forward, SageAttention-style) returning the log-sum-exp.

Q, K and V are rotated, smoothed and quantized first, by the reference's own code
(``ops.quantized_attention.quantize_inputs``: torch ops on the device, a pass over each tensor);
the kernel ``_qattention`` then has the flash structure of ``attention._attention``: a program per
(query block, batch x head) keeps its quantized query tile in registers and streams key and value
tiles through an online softmax in fp32.

* **QKᵀ**: ``tl.dot`` of int8 tiles accumulating exactly in int32 (``qk="int8"``), or of e4m3 tiles in
  fp32 (``"fp8"``); then ``* (scale_q * scale_k)`` and ``* scale``, the reference's fp32 operations in
  its order (launched without multiply-add contraction), so the int8 logits are the reference's bit
  for bit (``LOGITS`` writes them, for the test that says so).
* **PV**: P = exp(logits - running max), quantized as the reference quantizes it (``P * 448`` to e4m3,
  or ``P * 127`` rounded to int8), times the quantized V tile in the MMA's format, each tile's product
  in fp32 (on Hopper an fp8 MMA accumulates with fewer bits within a tile, Triton's default), the
  tiles summed in fp32 with the online softmax's rescaling; at the end ``/ 448 * scale_v / l``. P is quantized against the
  maximum so far (as SageAttention does), over key tiles of ``K_BLOCK`` (64) keys, which is how the
  reference defines it; the rescaling's fp32 order differs from the reference's, so the output is
  compared at SQNR. ``pv="float"`` is the plain flash product in the inputs' dtype.

Under Triton's interpreter (CI) the fp8 values are rounded by ``rounding.fp8_rne`` and multiplied in
fp32 (the interpreter's own float8 conversion rounds wrongly at binade edges). Masks are not taken: a
masked call runs the reference (the seam's transformers call attention without one). FP8 needs
compute capability 8.9 (Ada, Hopper), INT8 8.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.quantized_attention import K_BLOCK, check_quantized_attention, quantize_inputs
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.attention import HEAD_DIMS
from sdkiln.kernels.triton.configs import INTERPRET, KERNEL_NAME, attention_config, capability
from sdkiln.kernels.triton.rounding import fp8_rne, rounded
from sdkiln.kernels.triton.rows import FLOATS

MIN_DOT_K = 32
"""Triton's NVIDIA backend takes 8-bit ``tl.dot`` operands with an inner dimension of 32 or more: a
head dim of 16 runs the reference on a GPU."""
FP8_MIN_CAPABILITY = (8, 9)
INT8_MIN_CAPABILITY = (8, 0)
QK_INT8, QK_FP8 = 0, 1
PV_FP8, PV_INT8, PV_FLOAT = 0, 1, 2
_QK = {"int8": QK_INT8, "fp8": QK_FP8}
_PV = {"fp8": PV_FP8, "int8": PV_INT8, "float": PV_FLOAT}


@triton.jit
def _qattention(
    q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, shift_ptr, o_ptr, lse_ptr, logits_ptr,
    H, Sq, Sk, scale,
    sob, sos, soh,
    D: tl.constexpr, DV: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, EMULATE: tl.constexpr,
    LOGITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    qblock = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rm = (qblock * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rd = tl.arange(0, D)
    rdv = tl.arange(0, DV)
    m_in = rm < Sq
    # quantized inputs are [B, H, S, D] contiguous; fp8 arrives as bytes (no fp8 load to fill)
    q = tl.load(q_ptr + (bh * Sq + rm[:, None]) * D + rd[None, :], mask=m_in[:, None], other=0)
    if QK == 1:
        q = q.to(tl.float8e4nv, bitcast=True)
    if EMULATE:
        q = q.to(tl.float32)
    q_scale = tl.load(qs_ptr + bh * Sq + rm, mask=m_in, other=0.0)
    v_scale = tl.load(vs_ptr + bh * DV + rdv)
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DV), tl.float32)
    for start in range(0, Sk, BLOCK_N):
        rn = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_in = rn < Sk
        k = tl.load(k_ptr + (bh * Sk + rn[None, :]) * D + rd[:, None], mask=n_in[None, :], other=0)
        v = tl.load(v_ptr + (bh * Sk + rn[:, None]) * DV + rdv[None, :], mask=n_in[:, None], other=0)
        if QK == 1:
            k = k.to(tl.float8e4nv, bitcast=True)
        if PV == 0:
            v = v.to(tl.float8e4nv, bitcast=True)
        if EMULATE:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        elif QK == 0:
            s = tl.dot(q, k)  # int32, exact
        else:
            s = tl.dot(q, k, out_dtype=tl.float32)
        k_scale = tl.load(ks_ptr + bh * Sk + rn, mask=n_in, other=0.0)
        s = s.to(tl.float32) * (q_scale[:, None] * k_scale[None, :]) * scale
        if LOGITS:
            tl.store(
                logits_ptr + (bh * Sq + rm[:, None]) * Sk + rn[None, :], s, mask=m_in[:, None] & n_in[None, :]
            )
        s = tl.where(n_in[None, :], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(s - safe_max[:, None])
        alpha = tl.exp(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        if PV == 0:
            if EMULATE:
                pv = tl.dot(fp8_rne(p * 448.0), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot((p * 448.0).to(tl.float8e4nv), v, out_dtype=tl.float32)
        elif PV == 1:
            p_q = _rint(p * 127.0)
            if EMULATE:
                pv = tl.dot(p_q, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p_q.to(tl.int8), v).to(tl.float32)
        elif EMULATE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        running_max = new_max
    if PV == 0:
        acc = acc / 448.0 * v_scale[None, :]
    elif PV == 1:
        acc = acc / 127.0 * v_scale[None, :]
    out = acc / running_sum[:, None]
    lse = running_max + tl.log(running_sum) + tl.load(shift_ptr + bh * Sq + rm, mask=m_in, other=0.0)
    b = bh // H
    h = bh % H
    tl.store(
        o_ptr + b * sob + h * soh + rm[:, None] * sos + rdv[None, :],
        rounded(out, o_ptr.dtype.element_ty),
        mask=m_in[:, None],
    )
    tl.store(lse_ptr + (b * Sq + rm) * H + h, lse, mask=m_in)


@triton.jit
def _rint(x):
    """fp32 x (|x| < 2**22) rounded to the nearest integer, ties to even, as torch.round does."""
    return (x + 12582912.0) - 12582912.0


def _bytes(t: Tensor) -> Tensor:
    """fp8 values as their bytes (the kernel reinterprets them), other tensors as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def launch(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, qk: str, pv: str, rotate: bool, logits: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(out, lse, and with ``logits`` the kernel's scaled logits [B, H, Sq, Sk] fp32: a test's view)."""
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    x = quantize_inputs(q, k, v, scale, qk, pv, rotate)
    if pv == "float" and not INTERPRET:
        x.v = x.v.to(q.dtype)
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, sq, h), dtype=torch.float32, device=q.device)
    seen = torch.empty((b, h, sq, sk) if logits else (1,), dtype=torch.float32, device=q.device)
    config = attention_config(max(d, dv)) | {
        "BLOCK_N": K_BLOCK
    }  # P is quantized per key block of the reference
    block_m = config.pop("BLOCK_M")
    if b and sq and h:
        wrap_triton(_qattention)[(triton.cdiv(sq, block_m), b * h)](
            *(_bytes(t.contiguous()) for t in (x.q, x.q_scale, x.k, x.k_scale, x.v, x.v_scale, x.shift)),
            out, lse, seen, h, sq, sk, x.scale,
            out.stride(0), out.stride(1), out.stride(2),
            D=d, DV=dv, QK=_QK[qk], PV=_PV[pv], EMULATE=INTERPRET, LOGITS=logits,
            BLOCK_M=block_m, enable_fp_fusion=False, **config,
        )  # fmt: skip
    return out, lse, seen if logits else None


@triton_op("sdkiln_triton::quantized_attention", mutates_args=())
def quantized_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, qk: str, pv: str, rotate: bool
) -> tuple[Tensor, Tensor]:
    check_quantized_attention(q, k, v, qk, pv, rotate)
    out, lse, _ = launch(q, k, v, scale, qk, pv, rotate)
    return out, lse


def _fits(q, k, v, mask, scale, qk, pv, rotate) -> bool:
    needs = FP8_MIN_CAPABILITY if "fp8" in (qk, pv) else INT8_MIN_CAPABILITY
    return (
        mask is None
        and (INTERPRET or capability() >= needs)
        and q.dtype in FLOATS
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and v.shape[-1] in HEAD_DIMS
        and (INTERPRET or q.shape[-1] >= MIN_DOT_K)
    )


register_kernel("quantized_attention", "cuda", KERNEL_NAME, supports=_fits)(quantized_attention)
