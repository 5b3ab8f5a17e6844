"""The quantized ``sdkiln`` ops on Ascend, mapped onto torch_npu's fused quantization ops.

Imported only by ``load_device_kernels("npu")`` (through ``sdkiln.kernels.npu``): torch_npu is
imported at the top, and each function registers itself as the op's "npu" kernel. Each function
takes its op schema's arguments in order and keeps the reference's contract (shapes, dtypes,
``[..., 1]`` scales); what torch_npu needs differently is adapted here:

* the quantized matmuls take the weight as ``x2``/``weight`` of shape [K, N]; our weights are
  [N, K] row-major, so they are passed as the transposed view ``weight.t()`` (no copy), the layout
  torch_npu's docs recommend for per-channel weights;
* their activations are 2-D [M, K]; leading dimensions are flattened and restored;
* per-token and per-channel scales are 1-D ([M] and [N]);
* ``npu_quant_matmul``, ``npu_dynamic_quant`` and ``npu_weight_quant_batchmatmul`` compute in and
  return float16 or bfloat16 only: a float32 model raises rather than silently running elsewhere;
* W8A8 (static) passes ``deq_scale`` as float32 and ``quant_bias`` as the int32 ``bias``, a
  combination ``npu_quant_matmul`` documents for float16 and bfloat16 outputs alike (no
  ``npu_trans_quant_param`` needed);
* W4A16's packed uint8 [N, K/2] is unpacked and repacked with ``npu_convert_weight_to_int4pack``
  (int32 words of eight int4) on every call: that op's documented input is plain int4 values, and
  its word layout is not documented well enough to reinterpret our bytes in place.

Signatures follow the torch_npu API reference; none of this has run on Ascend hardware
(``docs/ascend.md``).
"""

from __future__ import annotations

import torch
import torch_npu
from torch import Tensor

from sdkiln.kernels.int4 import unpack_int4
from sdkiln.kernels.ops.int8 import (
    check_quantize_per_tensor_int8,
    check_w8a8_linear,
    check_w8a8_static_linear,
)
from sdkiln.kernels.ops.weight_only import check_weight_only_linear
from sdkiln.kernels.registry import register_kernel

HALF_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_NAME = "torch_npu"


def check_half(op: str, what: str, dtype: torch.dtype) -> None:
    if dtype not in HALF_DTYPES:
        raise ValueError(
            f"sdkiln::{op} on Ascend: torch_npu's kernel takes float16 or bfloat16 {what}, got {dtype}; "
            "run the model in bfloat16 or float16 on the NPU"
        )


@register_kernel("quantize_per_token_int8", "npu", name=KERNEL_NAME)
def quantize_per_token_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``npu_dynamic_quant``: symmetric per-token int8 (``scale = rowmax(|x|) / 127``)."""
    check_half("quantize_per_token_int8", "activations", x.dtype)
    y, scale = torch_npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))
    return y.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


@register_kernel("w8a8_linear", "npu", name=KERNEL_NAME)
def w8a8_linear(
    x_q: Tensor,
    x_scale: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``npu_quant_matmul(x_q, weight.t(), weight_scale, pertoken_scale=x_scale, bias=bias)``:
    the int8 product dequantized per channel and per token, the float32 bias added."""
    check_w8a8_linear(x_q, x_scale, weight, weight_scale)
    check_half("w8a8_linear", "outputs", out_dtype)
    y = torch_npu.npu_quant_matmul(
        x_q.reshape(-1, x_q.shape[-1]),
        weight.t(),
        weight_scale.reshape(-1),
        pertoken_scale=x_scale.reshape(-1),
        bias=None if bias is None else bias.float(),
        output_dtype=out_dtype,
    )
    return y.reshape(*x_q.shape[:-1], weight.shape[0])


@register_kernel("quantize_per_tensor_int8", "npu", name=KERNEL_NAME)
def quantize_per_tensor_int8(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """``npu_quantize(x, scale, offset, torch.qint8, axis=-1, div_mode=True)``: ``round(x / scale + offset)``
    saturated to int8, the offset (an integer) as int8."""
    check_quantize_per_tensor_int8(x, scale, offset)
    return torch_npu.npu_quantize(
        x, scale.reshape(1), offset.reshape(1).to(torch.int8), torch.qint8, -1, True
    )


@register_kernel("w8a8_static_linear", "npu", name=KERNEL_NAME)
def w8a8_static_linear(
    x_q: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``npu_quant_matmul(x_q, weight.t(), deq_scale, bias=quant_bias)``: ``(x_q @ W.T + quant_bias) *
    deq_scale`` with the int32 bias added before the float32 scale, as the reference does."""
    check_w8a8_static_linear(x_q, weight, deq_scale, quant_bias)
    check_half("w8a8_static_linear", "outputs", out_dtype)
    y = torch_npu.npu_quant_matmul(
        x_q.reshape(-1, x_q.shape[-1]), weight.t(), deq_scale, bias=quant_bias, output_dtype=out_dtype
    )
    return y.reshape(*x_q.shape[:-1], weight.shape[0])


@register_kernel("weight_only_linear", "npu", name=KERNEL_NAME)
def weight_only_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    """``npu_weight_quant_batchmatmul(x, weight.t(), weight_scale.t(), bias=..., antiquant_group_size=...)``.

    The scale is cast to x's dtype ([1, N] per channel, [K/G, N] per group); the bias is float16 for
    float16 activations and float32 for bfloat16 ones, as MindIE SD passes it.
    """
    check_weight_only_linear(x, weight, weight_scale, group_size)
    check_half("weight_only_linear", "activations", x.dtype)
    if weight.dtype == torch.uint8:
        packed = torch_npu.npu_convert_weight_to_int4pack(unpack_int4(weight).to(torch.int32))
        weight_kn = packed.t()
    else:
        weight_kn = weight.t()
    groups = weight_scale.shape[-1]
    if bias is not None:
        bias = bias.float() if x.dtype == torch.bfloat16 else bias.to(x.dtype)
    y = torch_npu.npu_weight_quant_batchmatmul(
        x.reshape(-1, x.shape[-1]),
        weight_kn,
        weight_scale.to(x.dtype).t(),
        bias=bias,
        antiquant_group_size=group_size if groups > 1 else 0,
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])
