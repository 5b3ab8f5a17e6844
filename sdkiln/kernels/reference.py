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

from sdkiln.kernels.int4 import unpack_int4

INT8_QMAX = 127
# The largest K for which an int32 accumulator cannot overflow: K * 128 * 128 < 2**31.
W8A8_MAX_K = 2**17 - 1
# fp32 represents every integer up to 2**24 exactly, and an int8 product is at most 2**14, so a dot
# product over this many terms is exact in fp32 whatever order the matmul sums it in.
FP32_EXACT_CHUNK = 2**24 // 2**14
# e4m3fn's largest finite value, and the largest K for which fp8_matmul's fp64 sum is exact.
FP8_E4M3_MAX = 448.0
FP8_MAX_K = 2**17


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


def check_quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> None:
    """Rules of ``quantize_per_tensor_int8``; shared with its fake."""
    for name, t in [("scale", scale), ("offset", offset)]:
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(
                f"quantize_per_tensor_int8: {name} must be one float32 value (e.g. [1]), got {t.dtype} {tuple(t.shape)}"
            )


def quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Asymmetric per-tensor int8 with calibrated parameters: ``clamp(round(x / scale) + offset, -128, 127)``.

    In fp32: ``x / scale`` is a true division, rounded half to even (``torch.round``); ``offset``
    holds an integer in [-128, 127], so adding it is exact; then the clamp. Returns int8 of x's shape.
    """
    check_quantize_per_tensor_int8(x, scale, offset)
    q = torch.round(x.float() / scale.reshape(())) + offset.reshape(())
    return q.clamp_(-128, INT8_QMAX).to(torch.int8).contiguous()


def check_w8a8_static_linear(x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor) -> None:
    """Shape and dtype rules of ``w8a8_static_linear``; shared with its fake."""
    for name, t, dtype in [
        ("x_q", x_q, torch.int8),
        ("weight", weight, torch.int8),
        ("deq_scale", deq_scale, torch.float32),
        ("quant_bias", quant_bias, torch.int32),
    ]:
        if t.dtype != dtype:
            raise ValueError(f"w8a8_static_linear: {name} must be {dtype}, got {t.dtype}")
    if weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"w8a8_static_linear: weight must be [N, K] with K = x_q.shape[-1]; got x_q {tuple(x_q.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x_q.shape[-1] > W8A8_MAX_K:
        raise ValueError(
            f"w8a8_static_linear: K={x_q.shape[-1]} exceeds {W8A8_MAX_K}; split the layer along K"
        )
    n = weight.shape[0]
    if tuple(deq_scale.shape) != (n,) or tuple(quant_bias.shape) != (n,):
        raise ValueError(
            f"w8a8_static_linear: deq_scale and quant_bias must be [N={n}], got {tuple(deq_scale.shape)} "
            f"and {tuple(quant_bias.shape)}"
        )


def w8a8_static_linear(
    x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """Statically quantized int8 activations [..., K] times int8 weight [N, K]: [..., N] in out_dtype.

    ``y = float(x_q @ weight.T + quant_bias) * deq_scale``: the product is exact in int32 and
    ``quant_bias`` (which folds the float bias and the activation offset, see
    ``sdkiln.runtime.quant.w8a8_static``) is added in int32 -- the module that builds it guarantees the
    sum cannot overflow. Then one conversion to fp32, one multiplication by ``deq_scale`` and one
    rounding to out_dtype, so the result is bit-reproducible.
    """
    check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    lead = x_q.shape[:-1]
    acc = int8_matmul(x_q.reshape(-1, x_q.shape[-1]), weight) + quant_bias
    y = acc.float() * deq_scale
    return _contiguous(y, out_dtype).reshape(*lead, weight.shape[0])


def fp8_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
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
    for name, t, dtype in [
        ("x_q", x_q, torch.float8_e4m3fn),
        ("weight", weight, torch.float8_e4m3fn),
        ("x_scale", x_scale, torch.float32),
        ("weight_scale", weight_scale, torch.float32),
    ]:
        if t.dtype != dtype:
            raise ValueError(f"fp8_linear: {name} must be {dtype}, got {t.dtype}")
    if weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: weight must be [N, K] with K = x_q.shape[-1]; got x_q {tuple(x_q.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x_q.shape[-1] > FP8_MAX_K:
        raise ValueError(
            f"fp8_linear: K={x_q.shape[-1]} exceeds {FP8_MAX_K}, beyond which the fp64 accumulation is "
            "no longer exact; split the layer along K"
        )
    if tuple(x_scale.shape) != (*x_q.shape[:-1], 1):
        raise ValueError(f"fp8_linear: x_scale must be [..., 1] of x_q's rows, got {tuple(x_scale.shape)}")
    if tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise ValueError(f"fp8_linear: weight_scale must be [N, 1], got {tuple(weight_scale.shape)}")


def fp8_linear(
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
    and one rounding to out_dtype, as ``w8a8_linear``. A fused kernel (``torch._scaled_mm`` with
    row-wise scales, which accumulates in fp32) matches this to fp32 accumulation error.
    """
    check_fp8_linear(x_q, x_scale, weight, weight_scale)
    lead = x_q.shape[:-1]
    y = fp8_matmul(x_q.reshape(-1, x_q.shape[-1]), weight).float() * x_scale.reshape(-1, 1)
    y = y * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return _contiguous(y, out_dtype).reshape(*lead, weight.shape[0])


def check_weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, group_size: int) -> None:
    """Shape and dtype rules of ``weight_only_linear``; shared with its fake."""
    k = x.shape[-1]
    if not x.is_floating_point():
        raise ValueError(f"weight_only_linear: x must be a float tensor, got {x.dtype}")
    if weight.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"weight_only_linear: weight must be torch.int8 (one value a byte) or torch.uint8 (two int4 "
            f"values a byte), got {weight.dtype}"
        )
    packed = weight.dtype == torch.uint8
    if weight.dim() != 2 or weight.shape[1] != (k // 2 if packed else k) or (packed and k % 2):
        raise ValueError(
            f"weight_only_linear: a {weight.dtype} weight must be [N, {'K/2' if packed else 'K'}] with "
            f"K = x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if group_size < 0 or (group_size and k % group_size):
        raise ValueError(
            f"weight_only_linear: group_size must be 0 (per channel) or divide K={k}, got {group_size}"
        )
    groups = k // group_size if group_size else 1
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0], groups):
        raise ValueError(
            f"weight_only_linear: weight_scale must be float32 [N, {groups}] for group_size {group_size}, got "
            f"{weight_scale.dtype} {tuple(weight_scale.shape)}"
        )


def dequantize_weight(weight: Tensor, weight_scale: Tensor, group_size: int) -> Tensor:
    """fp32 [N, K] from int8 [N, K] or packed int4 uint8 [N, K/2] values and their scales.

    ``w = float(v) * scale`` per element, one correctly rounded product; ``group_size`` 0 means one
    scale per row ([N, 1]), otherwise scale ``[n, g]`` covers columns ``g*G`` to ``(g+1)*G - 1``.
    """
    values = (unpack_int4(weight) if weight.dtype == torch.uint8 else weight).float()
    n, k = values.shape
    if not group_size:
        return values * weight_scale
    return (values.reshape(n, k // group_size, group_size) * weight_scale.unsqueeze(-1)).reshape(n, k)


def weight_only_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    """Float activations [..., K] times a quantized weight: [..., N] in x's dtype (W8A16, W4A16).

    ``weight`` is int8 [N, K] or packed int4 uint8 [N, K/2] (``sdkiln.kernels.int4``); scales are
    per channel (``group_size`` 0, [N, 1]) or per group of ``group_size`` along K ([N, K/G]).
    In fp32: ``w = dequantize_weight(...)`` (exact up to one rounding per element),
    ``y = float(x) @ w.T`` (an fp32 matmul: as exact as the device's, not bit-reproducible across
    devices or batch shapes), ``y = y + float(bias)``, then one rounding to x's dtype. Kernels that
    dequantize in bf16/fp16 (torch_npu's ``npu_weight_quant_batchmatmul``) match it to that precision.
    """
    check_weight_only_linear(x, weight, weight_scale, group_size)
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]).float() @ dequantize_weight(weight, weight_scale, group_size).T
    if bias is not None:
        y = y + bias.float()
    return _contiguous(y, x.dtype).reshape(*lead, weight.shape[0])


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
