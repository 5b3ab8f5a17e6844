"""Normalization fused with activation quantization: the norm (or adaLN) in front of a quantized
linear writes int8 or float8 values and per-token scales directly, so a kernel reads the
activation once instead of writing the normalized tensor and reading it back to quantize it.

Numerics: exactly the two ops in sequence. The normalized values are rounded to x's dtype (as the
unfused norm returns them), then quantized per token as ``quantize_per_token_int8`` or
``fp8_quantize_per_token`` do. A fused kernel keeps that rounding in registers, so replacing the
pair by the fused op (the compile backend's ``norm_quantize`` pattern) changes nothing but the
norm's own fp32 summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import check_broadcast
from sdkiln.kernels.ops.fp8 import fp8_quantize_per_token_reference
from sdkiln.kernels.ops.int8 import quantize_per_token_int8_reference
from sdkiln.kernels.ops.norm import layer_norm_modulate_reference, per_sample, rms_norm_reference
from sdkiln.kernels.registry import define

QUANTIZERS = {
    torch.int8: quantize_per_token_int8_reference,
    torch.float8_e4m3fn: fp8_quantize_per_token_reference,
}


def check_qdtype(op: str, qdtype: torch.dtype) -> None:
    if qdtype not in QUANTIZERS:
        raise ValueError(f"{op}: qdtype must be torch.int8 or torch.float8_e4m3fn, got {qdtype}")


def rms_norm_quantize_reference(
    x: Tensor, weight: Tensor | None, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``quantize_per_token(rms_norm(x, weight, eps))`` to ``qdtype``: (values like x, fp32 [..., 1])."""
    check_qdtype("rms_norm_quantize", qdtype)
    return QUANTIZERS[qdtype](rms_norm_reference(x, weight, eps))


def layer_norm_modulate_quantize_reference(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``quantize_per_token(layer_norm_modulate(x, scale, shift, eps))`` to ``qdtype``."""
    check_qdtype("layer_norm_modulate_quantize", qdtype)
    return QUANTIZERS[qdtype](layer_norm_modulate_reference(x, scale, shift, eps))


def _quantized_like(x: Tensor, qdtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=qdtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def _fake_rms_norm_quantize(x, weight, eps, qdtype):
    check_qdtype("rms_norm_quantize", qdtype)
    return _quantized_like(x, qdtype)


def _fake_layer_norm_modulate_quantize(x, scale, shift, eps, qdtype):
    check_qdtype("layer_norm_modulate_quantize", qdtype)
    check_broadcast("layer_norm_modulate_quantize", x, per_sample(scale, x), per_sample(shift, x))
    return _quantized_like(x, qdtype)


define(
    "rms_norm_quantize(Tensor x, Tensor? weight, float eps, ScalarType qdtype) -> (Tensor, Tensor)",
    reference=rms_norm_quantize_reference,
    fake=_fake_rms_norm_quantize,
    differentiable=False,
)
define(
    "layer_norm_modulate_quantize(Tensor x, Tensor scale, Tensor shift, float eps, ScalarType qdtype) "
    "-> (Tensor, Tensor)",
    reference=layer_norm_modulate_quantize_reference,
    fake=_fake_layer_norm_modulate_quantize,
    differentiable=False,
)


def rms_norm_quantize(
    x: Tensor, weight: Tensor | None, eps: float = 1e-6, qdtype: torch.dtype = torch.int8
) -> tuple[Tensor, Tensor]:
    """RMSNorm then per-token quantization to int8 or float8_e4m3fn: (values, fp32 scales [..., 1])."""
    return torch.ops.sdkiln.rms_norm_quantize.default(x, weight, eps, qdtype)


def layer_norm_modulate_quantize(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6, qdtype: torch.dtype = torch.int8
) -> tuple[Tensor, Tensor]:
    """adaLN (``LayerNorm(x) * (1 + scale) + shift``) then per-token quantization to ``qdtype``."""
    return torch.ops.sdkiln.layer_norm_modulate_quantize.default(x, scale, shift, eps, qdtype)
