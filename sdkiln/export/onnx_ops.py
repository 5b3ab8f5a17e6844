"""ONNX forms of sdkiln's quantized ops, as QuantizeLinear / DequantizeLinear (QDQ) graphs.

The dynamo exporter keeps ``torch.ops.sdkiln.*`` calls as they are (each has a fake), and this table
tells it what each becomes (``custom_translation_table``). Every form computes what the op's CPU
reference computes, up to fp32 rounding order:

* ``quantize_per_token_int8(x)``: ``scale = max|x| / 127`` per token (1 where that is 0), then a
  blocked ``QuantizeLinear`` with one block per token (``axis=-1``, ``block_size=K``, opset 21),
  the dynamic per-token pattern in QDQ form.
* ``w8a8_linear(x_q, x_scale, W, w_scale, bias)``: ``DequantizeLinear(x_q, x_scale)`` per token,
  ``DequantizeLinear(W, w_scale, axis=0)`` per output channel, ``MatMul``, ``Add`` the bias.
* ``quantize_per_tensor_int8(x, scale, offset)``: ``QuantizeLinear(x, scale, offset)``. ONNX adds
  the zero point after rounding and sdkiln before (as torch_npu does), so at an exact tie with an
  odd offset the two differ by one step; the tests' bound covers it.
* ``w8a8_static_linear(x_q, W, deq_scale, quant_bias)``: ``(x_q @ W.T + quant_bias) * deq_scale``
  as ``float(x_q) @ DequantizeLinear(W, deq_scale, axis=0).T + quant_bias * deq_scale``.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_OPSET = 21
"""Blocked QuantizeLinear / DequantizeLinear (the per-token scales) need opset 21."""


def translations() -> dict[Any, Any]:
    """``custom_translation_table`` for ``torch.onnx.export``: sdkiln op -> its ONNX function."""
    from onnxscript import ir
    from onnxscript import opset21 as op

    def _float_out(y, out_dtype):
        # the exporter passes the op's ScalarType argument as an ONNX data type; the graphs compute in
        # fp32, as the references do, and round once to the output dtype
        dtype = ir.DataType(out_dtype)
        return y if dtype == ir.DataType.FLOAT else op.Cast(y, to=dtype)

    def quantize_per_token_int8(x):
        k = x.shape[-1]  # the feature size is static: one block per token
        xf = op.Cast(x, to=ir.DataType.FLOAT)
        absmax = op.ReduceMax(op.Abs(xf), op.Constant(value_ints=[-1]), keepdims=1)
        scale = op.Div(absmax, op.Constant(value_float=127.0))
        scale = op.Where(op.Greater(scale, op.Constant(value_float=0.0)), scale, op.Constant(value_float=1.0))
        q = op.QuantizeLinear(xf, scale, axis=-1, block_size=k, output_dtype=ir.DataType.INT8)
        return q, scale

    def w8a8_linear(x_q, x_scale, weight, weight_scale, bias, out_dtype):
        k = weight.shape[1]
        x = op.DequantizeLinear(x_q, x_scale, axis=-1, block_size=k)
        w = op.DequantizeLinear(weight, op.Reshape(weight_scale, op.Constant(value_ints=[-1])), axis=0)
        y = op.MatMul(x, op.Transpose(w, perm=[1, 0]))
        if bias is not None:
            y = op.Add(y, op.Cast(bias, to=ir.DataType.FLOAT))
        return _float_out(y, out_dtype)

    def quantize_per_tensor_int8(x, scale, offset):
        zero = op.Cast(op.Squeeze(offset), to=ir.DataType.INT8)
        return op.QuantizeLinear(op.Cast(x, to=ir.DataType.FLOAT), op.Squeeze(scale), zero)

    def w8a8_static_linear(x_q, weight, deq_scale, quant_bias, out_dtype):
        w = op.DequantizeLinear(weight, deq_scale, axis=0)
        y = op.MatMul(op.Cast(x_q, to=ir.DataType.FLOAT), op.Transpose(w, perm=[1, 0]))
        y = op.Add(y, op.Mul(op.Cast(quant_bias, to=ir.DataType.FLOAT), deq_scale))
        return _float_out(y, out_dtype)

    ops = torch.ops.sdkiln
    return {
        ops.quantize_per_token_int8.default: quantize_per_token_int8,
        ops.w8a8_linear.default: w8a8_linear,
        ops.quantize_per_tensor_int8.default: quantize_per_tensor_int8,
        ops.w8a8_static_linear.default: w8a8_static_linear,
    }
