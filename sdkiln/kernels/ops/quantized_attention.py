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
3. **Quantize Q and K**, Q per query token and K per block of ``K_BLOCK`` (64) keys, per batch and
   head: ``scale = absmax(block) / 127`` and ``round(x / scale)`` clamped to [-127, 127]
   (``qk="int8"``), or ``scale = absmax / 448`` and an e4m3fn cast of the clamped quotient
   (``qk="fp8"``). A block of zeros gets scale 1. Per token, a query's values do not depend on which
   other queries share the call, so a rank holding part of the queries (sequence parallelism, padding)
   quantizes them as one device does; a kernel reads one scale per query row either way.
4. **Logits**: the exact integer (or exact fp8) products ``Qq Kqᵀ`` (float64, exact: at most D x
   127² per entry), converted to fp32, times ``scale_q * scale_k`` (fp32, that order), times the
   softmax scale (default 1/sqrt(D)); then the mask (boolean True attends, a float mask adds).
5. **Softmax pieces**: ``m`` the row max, ``P = exp(logits - m)`` in [0, 1], ``l = sum(P)`` and
   ``lse = m + log(l)`` plus the smoothing's shift ``scale * q · mean(k)`` (fp32, from the unquantized
   q), so that the lse is that of the unsmoothed logits and partial results over split keys merge
   (ring attention); a row that attends to nothing gets out 0 and lse -inf.
6. **PV**: ``pv="fp8"``: V as e4m3fn per channel over the keys (``scale_v = absmax / 448``); P per
   block of ``K_BLOCK`` keys against the running maximum, as a flash kernel sees it: for key block j,
   ``M_j`` the row maximum over blocks 0..j, ``Pq_j`` the e4m3fn of ``exp(logits_j - M_j) * 448``
   (in [0, 448]: one scale for all); the exact fp8 products ``Pq_j @ Vq_j`` (float64), in fp32, summed
   over j with weights ``exp(M_j - m)``, divided by 448, times ``scale_v``. (Against the final maximum
   P would round on another grid wherever the maximum moved: a kernel could then only match at about
   35 dB.) ``pv="int8"``: the same with 127 and rounding. ``pv="float"``: ``P @ V`` in fp32. Then
   divided by ``l`` and rounded to q's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sdkiln.kernels.ops.attention import check_attention
from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.ops.fp8 import FP8_E4M3_MAX
from sdkiln.kernels.registry import define

Q_BLOCK = 1
"""Queries are quantized per token (a block of one)."""
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


@dataclass
class Quantized:
    """Steps 1-3 of the module docstring and V's quantization (step 6), shared by the reference and
    the kernels, which take over from the logits: Q and K values [B, H, S, D] (int8 or e4m3fn) with
    their fp32 scales per token [B, H, S] (each block's scale repeated over its tokens), ``shift``
    [B, H, Sq] fp32 (``scale * q · mean(k)``, the lse's correction), V [B, H, Sk, Dv] (fp32 for
    ``pv="float"``, else int8 or e4m3fn) with its per-channel scale [B, H, Dv] (ones for float)."""

    q: Tensor
    q_scale: Tensor
    k: Tensor
    k_scale: Tensor
    shift: Tensor
    v: Tensor
    v_scale: Tensor
    scale: float


def quantize_inputs(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None, qk: str, pv: str, rotate: bool
) -> Quantized:
    """Rotate, smooth and quantize q, k ([B, S, H, D]) and quantize v, as the module docstring says."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if rotate:
        r = hadamard(q.shape[-1], q.device)
        qh, kh = qh @ r, kh @ r
    k_mean = kh.mean(dim=2, keepdim=True)
    q_q, q_scale = quantize_blocks(qh, Q_BLOCK, qk)
    k_q, k_scale = quantize_blocks(kh - k_mean, K_BLOCK, qk)
    shift = (qh @ k_mean.transpose(-1, -2)).squeeze(-1) * scale
    if pv == "float":
        v_q, v_scale = vh, vh.new_ones(vh.shape[:2] + vh.shape[-1:])
    else:
        top = INT8_MAX if pv == "int8" else FP8_E4M3_MAX
        v_scale = vh.abs().amax(dim=2) / top  # per channel over the keys: [B, H, Dv]
        v_scale = torch.where(v_scale > 0, v_scale, torch.ones_like(v_scale))
        v_q = _quantize(vh / v_scale[:, :, None], top, pv)
    return Quantized(q_q, q_scale.squeeze(-1), k_q, k_scale.squeeze(-1), shift, v_q, v_scale, scale)


def quantized_logits(x: Quantized) -> Tensor:
    """The scaled logits [B, H, Sq, Sk] fp32 (step 4 before the mask): exact integer (or fp8)
    products, then ``* (scale_q * scale_k)`` and ``* scale``, each a rounded fp32 operation."""
    return qk_logits_int(x.q, x.k).float() * (x.q_scale[..., :, None] * x.k_scale[..., None, :]) * x.scale


def quantized_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, qk: str, pv: str, rotate: bool
) -> tuple[Tensor, Tensor]:
    """The module docstring's steps, in its order."""
    check_quantized_attention(q, k, v, qk, pv, rotate)
    x = quantize_inputs(q, k, v, scale, qk, pv, rotate)
    logits = quantized_logits(x)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    m = logits.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == -math.inf, 0.0)
    p = torch.exp(logits - m)
    l_ = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(l_)).squeeze(-1) + x.shift
    if pv == "float":
        out = p @ x.v
    else:
        out = _quantized_pv(logits, m, x, pv)
    out = torch.where(l_ > 0, out / l_.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out))
    return contiguous_as(out.transpose(1, 2), q.dtype), lse.transpose(1, 2).contiguous()


def _quantized_pv(logits: Tensor, m: Tensor, x: Quantized, pv: str) -> Tensor:
    """Step 6 for a quantized P: ``sum_j exp(M_j - m) * (Pq_j @ Vq_j)`` over key blocks j of ``K_BLOCK``,
    ``M_j`` the running maximum through block j (0 while it is -inf), ``Pq_j`` the quantized
    ``exp(logits_j - M_j) * top``; each block's product exact (float64), in fp32; then ``/ top * scale_v``."""
    top = INT8_MAX if pv == "int8" else FP8_E4M3_MAX
    sk = logits.shape[-1]
    n = -(-sk // K_BLOCK)
    blocks = torch.nn.functional.pad(logits, (0, n * K_BLOCK - sk), value=-math.inf)
    blocks = blocks.unflatten(-1, (n, K_BLOCK))  # [B, H, Sq, n, K_BLOCK]
    running = blocks.amax(dim=-1).cummax(dim=-1).values  # [B, H, Sq, n]
    running = running.masked_fill(running == -math.inf, 0.0)
    p_q = _quantize(torch.exp(blocks - running[..., None]) * top, top, pv)
    v_q = torch.nn.functional.pad(x.v.double(), (0, 0, 0, n * K_BLOCK - sk)).unflatten(-2, (n, K_BLOCK))
    partial = torch.einsum("bhqnk,bhnkd->bhqnd", p_q.double(), v_q).float()  # [B, H, Sq, n, Dv]
    out = (partial * torch.exp(running - m)[..., None]).sum(dim=-2)
    return out / top * x.v_scale[:, :, None]


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
