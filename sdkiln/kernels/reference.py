"""Pure-torch references of the ``sdkiln`` ops: the CPU implementation, the fallback on any
device without a fused kernel, and the oracle that every fused kernel is tested against.

Numerics contract, which a fused kernel must follow to match these functions:

* Float ops compute in fp32 and round once, to the input's dtype, at the end. In fp32 they equal
  the plain torch formula to within 1e-5; in bf16/fp16 they can be more accurate than eager
  diffusers, which rounds after every op.
* Quantized ops are bit-reproducible: integer parts are exact, and the float steps run in the
  order written in their docstrings, each one correctly rounded (no fused multiply-add, no
  reciprocal in place of a division).
* Outputs are contiguous and never alias an input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

INT8_QMAX = 127
# The largest K for which an int32 accumulator cannot overflow: K * 128 * 128 < 2**31.
W8A8_MAX_K = 2**17 - 1
# fp32 represents every integer up to 2**24 exactly, and an int8 product is at most 2**14, so a dot
# product over this many terms is exact in fp32 whatever order the matmul sums it in.
FP32_EXACT_CHUNK = 2**24 // 2**14


def _contiguous(y: Tensor, dtype: torch.dtype) -> Tensor:
    return y.to(dtype, memory_format=torch.contiguous_format)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last axis."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return _contiguous(y, x.dtype)


def check_broadcast(op: str, x: Tensor, *operands: Tensor) -> None:
    """The operands of an elementwise op on x must broadcast to x's shape without growing it."""
    shape = torch.broadcast_shapes(x.shape, *(t.shape for t in operands))
    if shape != x.shape:
        raise ValueError(
            f"{op}: operands {[tuple(t.shape) for t in operands]} broadcast x {tuple(x.shape)} to {tuple(shape)}"
        )


def per_sample(mod: Tensor, x: Tensor) -> Tensor:
    """A [B, D] modulation of a [B, S, D] input applies to every token of sample b."""
    return mod.unsqueeze(1) if x.dim() == 3 and mod.dim() == 2 else mod


def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """``LayerNorm(x, no affine) * (1 + scale) + shift``, the adaLN modulation of DiT/FLUX blocks.

    For x [B, S, D], scale and shift are [B, D] (one row per sample) or anything that broadcasts
    against x, such as [B, 1, D].
    """
    scale, shift = per_sample(scale, x), per_sample(shift, x)
    check_broadcast("layer_norm_modulate", x, scale, shift)
    y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    y = y * (1 + scale.float()) + shift.float()
    return _contiguous(y, x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding ``x * cos + rotate(x) * sin``, as diffusers' ``apply_rotary_emb(use_real=True)``.

    x is [B, H, S, D] and cos/sin [S, D] (or any shape that broadcasts against x, e.g. [S, 1, D]
    for x [B, S, H, D]). ``interleaved=True`` rotates adjacent pairs (x0, x1), (x2, x3), ... as
    diffusers' ``use_real_unbind_dim=-1`` (FLUX, CogVideoX, HunyuanDiT); ``False`` rotates the two
    halves (x[:D/2], x[D/2:]) as ``use_real_unbind_dim=-2`` (rotate-half: Stable Audio, CogView4,
    Cosmos). The arithmetic is diffusers' own, so the result equals it bit for bit.
    """
    check_broadcast("rope", x, cos, sin)
    if interleaved:
        real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    else:
        real, imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        rotated = torch.cat([-imag, real], dim=-1)
    y = x.float() * cos.float() + rotated.float() * sin.float()
    return _contiguous(y, x.dtype)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))``."""
    return _contiguous(F.gelu(x.float(), approximate="tanh"), x.dtype)


def mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """``x * y + z`` with broadcasting (a gated residual: ``gate * branch + residual``).

    Computed in fp32 as a rounded multiply followed by a rounded add; the result has the promoted
    dtype of the three inputs.
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    return _contiguous(x.float() * y.float() + z.float(), dtype)


def quantize_per_token_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token int8: ``scale = absmax(x, -1) / 127``, ``q = clamp(round(x / scale))``.

    Returns int8 values of x's shape and fp32 scales [..., 1]. In fp32: the scale is the absmax
    divided by 127; a row whose scale is 0 (all zeros, or an absmax so small that the division
    underflows) gets scale 1.0 and all-zero values. Values are ``x / scale`` (a true division)
    rounded half to even (``torch.round``) and clamped to [-127, 127], so -128 never appears.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / scale).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def int8_matmul_fp32_chunks(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 a [M, K] and b [N, K], as int32, on any device with fp32 matmul.

    Each fp32 matmul covers at most ``FP32_EXACT_CHUNK`` (1024) terms of K, so its partial sums are
    integers of magnitude at most 2**24 and are exact in fp32 in any summation order; the chunks are
    then added in int32. This assumes that the device's fp32 matmul multiplies small integers exactly
    and accumulates in at least fp32, as CPU BLAS and cuBLAS (with or without TF32) do.
    """
    af, bf = a.float(), b.float()
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for k in range(0, a.shape[1], FP32_EXACT_CHUNK):
        end = k + FP32_EXACT_CHUNK
        acc += (af[:, k:end] @ bf[:, k:end].T).to(torch.int32)
    return acc


def int8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 a [M, K] and b [N, K], as int32.

    On CPU this is ``torch._int_mm``, exact for every shape and about 3.5x faster than an fp32
    matmul; elsewhere it is ``int8_matmul_fp32_chunks`` (``_int_mm`` on CUDA has shape limits, and
    NPUs lack it). Plain ``int8 @ int8`` wraps around in int8 and is never used.
    """
    if a.device.type == "cpu":
        return torch._int_mm(a, b.T)
    return int8_matmul_fp32_chunks(a, b)


def check_w8a8_linear(x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor) -> None:
    """Shape and dtype rules of ``w8a8_linear``; shared with its fake so torch.compile sees them too."""
    for name, t, dtype in [
        ("x_q", x_q, torch.int8),
        ("weight", weight, torch.int8),
        ("x_scale", x_scale, torch.float32),
        ("weight_scale", weight_scale, torch.float32),
    ]:
        if t.dtype != dtype:
            raise ValueError(f"w8a8_linear: {name} must be {dtype}, got {t.dtype}")
    if weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"w8a8_linear: weight must be [N, K] with K = x_q.shape[-1]; got x_q {tuple(x_q.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x_q.shape[-1] > W8A8_MAX_K:
        raise ValueError(
            f"w8a8_linear: K={x_q.shape[-1]} exceeds {W8A8_MAX_K}, beyond which the int32 accumulator "
            "can overflow; split the layer along K"
        )
    if tuple(x_scale.shape) != (*x_q.shape[:-1], 1):
        raise ValueError(f"w8a8_linear: x_scale must be [..., 1] of x_q's rows, got {tuple(x_scale.shape)}")
    if weight_scale.numel() != weight.shape[0] or weight_scale.dim() not in (1, 2):
        raise ValueError(f"w8a8_linear: weight_scale must be [N] or [N, 1], got {tuple(weight_scale.shape)}")


def w8a8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """int8 activations [..., K] times int8 weight [N, K], dequantized: returns [..., N] in out_dtype.

    ``acc = x_q @ weight.T`` is exact in int32 (K <= 131071). Then, in fp32 and in this order:
    ``y = (float(acc) * x_scale) * weight_scale.T``, ``y = y + float(bias)``, and finally one
    rounding to out_dtype. Every step is correctly rounded, so the result is bit-reproducible and a
    row does not depend on which other rows are in the batch.
    """
    check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    lead = x_q.shape[:-1]
    acc = int8_matmul(x_q.reshape(-1, x_q.shape[-1]), weight)
    y = acc.float() * x_scale.reshape(-1, 1)
    y = y * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return _contiguous(y, out_dtype).reshape(*lead, weight.shape[0])


def check_attention(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shape rules of ``attention``; shared with its fake."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be [B, H, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            "attention: q [B, H, Sq, D], k [B, H, Sk, D] and v [B, H, Sk, Dv] disagree: "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention that also returns the log-sum-exp of each query's logits.

    q [B, H, Sq, D], k [B, H, Sk, D], v [B, H, Sk, Dv]; ``scale`` defaults to 1/sqrt(D). The mask
    broadcasts to [B, H, Sq, Sk]: boolean True means "attend" (as in
    ``F.scaled_dot_product_attention``), a float mask is added to the scaled logits. Returns
    ``out`` [B, H, Sq, Dv] in q's dtype and ``lse = logsumexp(scale * q @ k.T + mask)`` [B, H, Sq]
    in fp32 (natural log), the quantity needed to merge attention over split keys (ring attention).
    A query that may attend to nothing gets ``out = 0`` and ``lse = -inf``, as SDPA's zeros.
    Computed in fp32.
    """
    check_attention(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    out = probs @ v.float()
    return _contiguous(out, q.dtype), lse.contiguous()
