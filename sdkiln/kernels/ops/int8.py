"""int8 ops: per-token (dynamic) and per-tensor (static, calibrated) activation quantization, and
the int8 x int8 linears of W8A8_DYNAMIC and W8A8, exact in int32."""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import check_quantized_matmul, contiguous_as
from sdkiln.kernels.registry import define, define_composite, eager_call

INT8_QMAX = 127
# The largest K for which an int32 accumulator cannot overflow: K * 128 * 128 < 2**31.
W8A8_MAX_K = 2**17 - 1
# fp32 represents every integer up to 2**24 exactly, and an int8 product is at most 2**14, so a dot
# product over this many terms is exact in fp32 whatever order the matmul sums it in.
FP32_EXACT_CHUNK = 2**24 // 2**14


def quantize_per_token_int8_reference(x: Tensor) -> tuple[Tensor, Tensor]:
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


def int8_matmul_float64(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 a [M, K] and b [N, K], as int32, through one float64 matmul: every
    partial sum is an integer below 2**31 < 2**53, exact in any summation order and whatever fp32
    matmul precision or ISA the BLAS is set to."""
    return (a.double() @ b.double().T).to(torch.int32)


def int8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 a [M, K] and b [N, K], as int32: what the references use.

    On CPU this is ``int8_matmul_float64``; elsewhere ``int8_matmul_fp32_chunks``. Not
    ``torch._int_mm``: on a CPU without VNNI its oneDNN kernel sums pairs of u8 x s8 products in
    saturating int16 (``vpmaddubsw``) and is wrong by up to 65,279 in about 90% of the outputs of a
    full-range product (measured with ``ONEDNN_MAX_CPU_ISA=AVX2``; docs/kernels.md). The CPU kernels
    (``sdkiln.kernels.cpu.int8``) choose the fastest product that the CPU profile verified exact:
    the reference is the oracle, not the speed path. Plain ``int8 @ int8`` wraps around in int8 and
    is never used.
    """
    if a.device.type == "cpu":
        return int8_matmul_float64(a, b)
    return int8_matmul_fp32_chunks(a, b)


def check_w8a8_linear(x_q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor) -> None:
    """Shape and dtype rules of ``w8a8_linear``; shared with its fake so torch.compile sees them too."""
    check_quantized_matmul(
        "w8a8_linear",
        x_q,
        weight,
        W8A8_MAX_K,
        "the int32 accumulator can overflow",
        [
            ("x_q", x_q, torch.int8),
            ("weight", weight, torch.int8),
            ("x_scale", x_scale, torch.float32),
            ("weight_scale", weight_scale, torch.float32),
        ],
    )
    if tuple(x_scale.shape) != (*x_q.shape[:-1], 1):
        raise ValueError(f"w8a8_linear: x_scale must be [..., 1] of x_q's rows, got {tuple(x_scale.shape)}")
    if weight_scale.numel() != weight.shape[0] or weight_scale.dim() not in (1, 2):
        raise ValueError(f"w8a8_linear: weight_scale must be [N] or [N, 1], got {tuple(weight_scale.shape)}")


def w8a8_linear_reference(
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
    return w8a8_linear_with(int8_matmul, x_q, x_scale, weight, weight_scale, bias, out_dtype)


def w8a8_linear_with(product, x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    """``w8a8_linear_reference`` with another exact int8 product ``product(a, b) -> a @ b.T`` (int32,
    or a float tensor holding the exact integers): the same bits whichever exact product runs."""
    check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    lead = x_q.shape[:-1]
    acc = product(x_q.reshape(-1, x_q.shape[-1]), weight)
    y = acc.float() * x_scale.reshape(-1, 1)
    y = y * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return contiguous_as(y, out_dtype).reshape(*lead, weight.shape[0])


def check_quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> None:
    """Rules of ``quantize_per_tensor_int8``; shared with its fake."""
    for name, t in [("scale", scale), ("offset", offset)]:
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(
                f"quantize_per_tensor_int8: {name} must be one float32 value (e.g. [1]), got {t.dtype} {tuple(t.shape)}"
            )


def quantize_per_tensor_int8_reference(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Asymmetric per-tensor int8 with calibrated parameters: ``clamp(round(x / scale + offset), -128, 127)``.

    In fp32: ``x / scale`` is a true division; ``offset`` holds an integer in [-128, 127], so adding
    it is exact; then one rounding half to even (``torch.round``) and the clamp. The offset is added
    before rounding, as torch_npu's ``npu_quantize`` documents: with an odd offset the other order
    differs at ties, which half-precision inputs over an 8-bit scale hit often. Returns int8 of x's shape.
    """
    check_quantize_per_tensor_int8(x, scale, offset)
    q = torch.round(x.float() / scale.reshape(()) + offset.reshape(()))
    return q.clamp_(-128, INT8_QMAX).to(torch.int8).contiguous()


def check_w8a8_static_linear(x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor) -> None:
    """Shape and dtype rules of ``w8a8_static_linear``; shared with its fake."""
    check_quantized_matmul(
        "w8a8_static_linear",
        x_q,
        weight,
        W8A8_MAX_K,
        "the int32 accumulator can overflow",
        [
            ("x_q", x_q, torch.int8),
            ("weight", weight, torch.int8),
            ("deq_scale", deq_scale, torch.float32),
            ("quant_bias", quant_bias, torch.int32),
        ],
    )
    n = weight.shape[0]
    if tuple(deq_scale.shape) != (n,) or tuple(quant_bias.shape) != (n,):
        raise ValueError(
            f"w8a8_static_linear: deq_scale and quant_bias must be [N={n}], got {tuple(deq_scale.shape)} "
            f"and {tuple(quant_bias.shape)}"
        )


def w8a8_static_linear_reference(
    x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """Statically quantized int8 activations [..., K] times int8 weight [N, K]: [..., N] in out_dtype.

    ``y = float(x_q @ weight.T + quant_bias) * deq_scale``: the product is exact in int32 and
    ``quant_bias`` (which folds the float bias and the activation offset, see
    ``sdkiln.runtime.quant.w8a8_static``) is added in int32 -- the module that builds it guarantees the
    sum cannot overflow. Then one conversion to fp32, one multiplication by ``deq_scale`` and one
    rounding to out_dtype, so the result is bit-reproducible.
    """
    return w8a8_static_linear_with(int8_matmul, x_q, weight, deq_scale, quant_bias, out_dtype)


def w8a8_static_linear_with(product, x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    """``w8a8_static_linear_reference`` with another exact int8 product (see ``w8a8_linear_with``)."""
    check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    lead = x_q.shape[:-1]
    acc = product(x_q.reshape(-1, x_q.shape[-1]), weight).to(torch.int32) + quant_bias
    y = acc.float() * deq_scale
    return contiguous_as(y, out_dtype).reshape(*lead, weight.shape[0])


def _fake_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _fake_w8a8_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype) -> Tensor:
    check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _fake_quantize_per_tensor(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    check_quantize_per_tensor_int8(x, scale, offset)
    return x.new_empty(x.shape, dtype=torch.int8)


def _fake_w8a8_static_linear(x_q, weight, deq_scale, quant_bias, out_dtype) -> Tensor:
    check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    return x_q.new_empty((*x_q.shape[:-1], weight.shape[0]), dtype=out_dtype)


define(
    "quantize_per_token_int8(Tensor x) -> (Tensor, Tensor)",
    reference=quantize_per_token_int8_reference,
    fake=_fake_quantize_per_token,
    differentiable=False,
)
define(
    "w8a8_linear(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor",
    reference=w8a8_linear_reference,
    fake=_fake_w8a8_linear,
    differentiable=False,
)
define(
    "quantize_per_tensor_int8(Tensor x, Tensor scale, Tensor offset) -> Tensor",
    reference=quantize_per_tensor_int8_reference,
    fake=_fake_quantize_per_tensor,
    differentiable=False,
)
define(
    "w8a8_static_linear(Tensor x_q, Tensor weight, Tensor deq_scale, Tensor quant_bias, "
    "ScalarType out_dtype) -> Tensor",
    reference=w8a8_static_linear_reference,
    fake=_fake_w8a8_static_linear,
    differentiable=False,
)


def quantize_per_token_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-token int8 quantization: (int8 values like x, fp32 scales [..., 1])."""
    return torch.ops.sdkiln.quantize_per_token_int8.default(x)


def w8a8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """int8 x int8 linear, exact in int32, dequantized per token and per channel: [..., N]."""
    return torch.ops.sdkiln.w8a8_linear.default(x_q, x_scale, weight, weight_scale, bias, out_dtype)


def quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """Asymmetric per-tensor int8 with calibrated ``scale`` and integer ``offset`` (fp32, one value
    each): ``clamp(round(x / scale) + offset, -128, 127)``."""
    return torch.ops.sdkiln.quantize_per_tensor_int8.default(x, scale, offset)


def w8a8_static_linear(
    x_q: Tensor,
    weight: Tensor,
    deq_scale: Tensor,
    quant_bias: Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """int8 x int8 linear with static activation parameters: ``(x_q @ weight.T + quant_bias) * deq_scale``."""
    return torch.ops.sdkiln.w8a8_static_linear.default(x_q, weight, deq_scale, quant_bias, out_dtype)


def w8a8_linear_from_float_reference(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """W8A8_DYNAMIC's linear from float activations: ``quantize_per_token_int8`` then ``w8a8_linear``
    to x's dtype, each dispatched as the op it is."""
    x_q, x_scale = quantize_per_token_int8(x)
    return w8a8_linear(x_q, x_scale, weight, weight_scale, bias, x.dtype)


def w8a8_static_linear_from_float_reference(
    x: Tensor,
    input_scale: Tensor,
    input_offset: Tensor,
    weight: Tensor,
    deq_scale: Tensor,
    quant_bias: Tensor,
) -> Tensor:
    """W8A8's linear from float activations: ``quantize_per_tensor_int8`` then ``w8a8_static_linear``."""
    x_q = quantize_per_tensor_int8(x, input_scale, input_offset)
    return w8a8_static_linear(x_q, weight, deq_scale, quant_bias, x.dtype)


define_composite("w8a8_linear_from_float", w8a8_linear_from_float_reference)
define_composite("w8a8_static_linear_from_float", w8a8_static_linear_from_float_reference)


def w8a8_linear_from_float(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """Quantize x per token and run the int8 linear: [..., N] in x's dtype. A composite: a CPU kernel
    may fuse both in one call (``sdkiln.kernels.registry``), bit for bit the same."""
    return eager_call("w8a8_linear_from_float", x, weight, weight_scale, bias)


def w8a8_static_linear_from_float(
    x: Tensor,
    input_scale: Tensor,
    input_offset: Tensor,
    weight: Tensor,
    deq_scale: Tensor,
    quant_bias: Tensor,
) -> Tensor:
    """Quantize x with the calibrated per-tensor parameters and run the static int8 linear (a composite)."""
    return eager_call(
        "w8a8_static_linear_from_float", x, input_scale, input_offset, weight, deq_scale, quant_bias
    )
