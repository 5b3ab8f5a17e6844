"""Quantized attention (SageAttention-style): Q and K in INT8 (or FP8) per block of tokens with K
smoothed, P and V in FP8 (or INT8, or float), an optional Hadamard rotation of Q and K along the
head dimension. The reference is the CPU implementation and the oracle of every kernel.

``quantized_attention(q, k, v, mask, scale, qk, pv, rotate)``, q, k, v [B, S, H, D] (diffusers'
dispatch layout, as ``attention``), returns ``(out [B, Sq, H, Dv] in q's dtype, lse [B, Sq, H] fp32)``.
In order, each step in fp32 unless it says otherwise:

1. **Rotate** (``rotate``): ``q @ R`` and ``k @ R`` with ``R`` the orthonormal Walsh-Hadamard matrix
   of order D (a power of two): ``(qR)(kR)ᵀ = qkᵀ``, with outlier channels spread over all D.
2. **Smooth K**: ``k - mean(k)`` over the keys, per batch, head and channel. Every logit of a query
   changes by the same ``q · mean(k)``, which softmax cancels: exact in real arithmetic, and K's
   per-channel offset no longer spends the int8 range.
3. **Quantize Q and K** per block of ``Q_BLOCK`` (128) queries and ``K_BLOCK`` (64) keys, per batch
   and head: ``scale = absmax(block) / 127`` and ``round(x / scale)`` clamped to [-127, 127]
   (``qk="int8"``), or ``scale = absmax / 448`` and an e4m3fn cast of the clamped quotient
   (``qk="fp8"``). A block of zeros gets scale 1.
4. **Logits**: the exact integer (or exact fp8) products ``Qq Kqᵀ`` (float64, exact: at most D x
   127² per entry), converted to fp32, times ``scale_q * scale_k`` (fp32, that order), times the
   softmax scale (default 1/sqrt(D)); then the mask (boolean True attends, a float mask adds).
5. **Softmax pieces**: ``m`` the row max, ``P = exp(logits - m)`` in [0, 1], ``l = sum(P)`` and
   ``lse = m + log(l)`` plus the smoothing's shift ``scale * q · mean(k)`` (fp32, from the unquantized
   q), so that the lse is that of the unsmoothed logits and partial results over split keys merge
   (ring attention); a row that attends to nothing gets out 0 and lse -inf.
6. **PV**: ``pv="fp8"``: P as e4m3fn of ``P * 448`` (one scale for all), V as e4m3fn per channel
   over the keys (``scale_v = absmax / 448``); the exact fp8 product (float64), in fp32, divided by
   448, times ``scale_v``. ``pv="int8"``: the same with 127 and rounding. ``pv="float"``: ``P @ V``
   in fp32. Then divided by ``l`` and rounded to q's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sdkiln.kernels.ops.attention import check_attention
from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.ops.fp8 import FP8_E4M3_MAX
from sdkiln.kernels.registry import define

Q_BLOCK = 128
K_BLOCK = 64
QK_FORMATS = ("int8", "fp8")
PV_FORMATS = ("fp8", "int8", "float")
INT8_MAX = 127.0


def hadamard(d: int, device=None) -> Tensor:
    """The orthonormal Walsh-Hadamard matrix of order ``d`` (a power of two), fp32."""
    if d < 1 or d & (d - 1):
        raise ValueError(
            f"quantized_attention: a Hadamard rotation needs a power-of-two head dimension, got {d}"
        )
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def check_quantized_attention(q: Tensor, k: Tensor, v: Tensor, qk: str, pv: str, rotate: bool) -> None:
    """Argument rules of ``quantized_attention``; shared with its fake."""
    check_attention(q, k, v)
    if qk not in QK_FORMATS:
        raise ValueError(f"quantized_attention: qk must be one of {', '.join(QK_FORMATS)}, got {qk!r}")
    if pv not in PV_FORMATS:
        raise ValueError(f"quantized_attention: pv must be one of {', '.join(PV_FORMATS)}, got {pv!r}")
    d = q.shape[-1]
    if rotate and (d < 1 or d & (d - 1)):
        raise ValueError(
            f"quantized_attention: a Hadamard rotation needs a power-of-two head dimension, got {d}"
        )


def quantize_blocks(x: Tensor, block: int, fmt: str) -> tuple[Tensor, Tensor]:
    """x [B, H, S, D] fp32 -> (values of x's shape as int8 or float8_e4m3fn, fp32 scales [B, H, S, 1],
    one per block of ``block`` tokens, repeated over the block's tokens)."""
    b, h, s, d = x.shape
    pad = (-s) % block
    blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b, h, (s + pad) // block, block * d)
    top = INT8_MAX if fmt == "int8" else FP8_E4M3_MAX
    scale = blocks.abs().amax(dim=-1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.repeat_interleave(block, dim=2)[:, :, :s]  # [B, H, S, 1]
    return _quantize(x / scale, top, fmt), scale


def _quantize(x: Tensor, top: float, fmt: str) -> Tensor:
    """``x`` (already divided by its scale) as int8 or e4m3fn values, clamped to ``top``."""
    if fmt == "int8":
        return torch.round(x).clamp_(-top, top).to(torch.int8)
    return x.clamp_(-top, top).to(torch.float8_e4m3fn)


def qk_logits_int(q_q: Tensor, k_q: Tensor) -> Tensor:
    """The exact products ``q_q @ k_qᵀ`` of [B, H, S, D] int8 or e4m3fn values, as float64: every
    entry is a sum of at most D products, each a multiple of 2**-18 below 2**18 (e4m3fn) or an
    integer of at most 127² (int8), which float64 holds exactly in any summation order."""
    return q_q.double() @ k_q.double().transpose(-1, -2)


def quantized_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, qk: str, pv: str, rotate: bool
) -> tuple[Tensor, Tensor]:
    """The module docstring's steps, in its order."""
    check_quantized_attention(q, k, v, qk, pv, rotate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if rotate:
        r = hadamard(q.shape[-1], q.device)
        qh, kh = qh @ r, kh @ r
    k_mean = kh.mean(dim=2, keepdim=True)
    kh = kh - k_mean
    q_q, q_scale = quantize_blocks(qh, Q_BLOCK, qk)
    k_q, k_scale = quantize_blocks(kh, K_BLOCK, qk)
    logits = qk_logits_int(q_q, k_q).float() * (q_scale * k_scale.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    m = logits.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == -math.inf, 0.0)
    p = torch.exp(logits - m)
    l_ = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(l_)).squeeze(-1) + (qh @ k_mean.transpose(-1, -2)).squeeze(-1) * scale
    if pv == "float":
        out = p @ vh
    else:
        top = INT8_MAX if pv == "int8" else FP8_E4M3_MAX
        v_scale = vh.abs().amax(dim=2, keepdim=True) / top  # per channel over the keys: [B, H, 1, Dv]
        v_scale = torch.where(v_scale > 0, v_scale, torch.ones_like(v_scale))
        p_q = _quantize(p * top, top, pv)
        v_q = _quantize(vh / v_scale, top, pv)
        out = (p_q.double() @ v_q.double()).float() / top * v_scale
    out = torch.where(l_ > 0, out / l_.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out))
    return contiguous_as(out.transpose(1, 2), q.dtype), lse.transpose(1, 2).contiguous()


def _fake(q, k, v, mask, scale, qk, pv, rotate) -> tuple[Tensor, Tensor]:
    check_quantized_attention(q, k, v, qk, pv, rotate)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


define(
    "quantized_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, str qk, str pv, bool rotate)"
    " -> (Tensor, Tensor)",
    reference=quantized_attention_reference,
    fake=_fake,
    differentiable=False,
)


def quantized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    qk: str = "int8",
    pv: str = "fp8",
    rotate: bool = False,
) -> tuple[Tensor, Tensor]:
    """Quantized attention of [B, S, H, D] tensors (module docstring): (out in q's dtype, fp32 lse)."""
    return torch.ops.sdkiln.quantized_attention.default(q, k, v, mask, scale, qk, pv, rotate)
