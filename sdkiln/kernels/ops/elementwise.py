"""Elementwise ops: ``gelu_tanh`` and ``mul_add`` (a gated residual), and the rules ops share: the
output rule, broadcasting, and the operands of a quantized matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sdkiln.kernels.registry import define


def contiguous_as(y: Tensor, dtype: torch.dtype) -> Tensor:
    """The op output rule: one rounding to ``dtype``, contiguous, never an alias of an input."""
    return y.to(dtype).contiguous()


def check_broadcast(op: str, x: Tensor, *operands: Tensor) -> None:
    """The operands of an elementwise op on x must broadcast to x's shape without growing it."""
    shape = torch.broadcast_shapes(x.shape, *(t.shape for t in operands))
    if shape != x.shape:
        raise ValueError(
            f"{op}: operands {[tuple(t.shape) for t in operands]} broadcast x {tuple(x.shape)} to {tuple(shape)}"
        )


def check_quantized_matmul(
    op: str, x_q: Tensor, weight: Tensor, max_k: int, why: str, dtypes: list[tuple[str, Tensor, torch.dtype]]
) -> None:
    """The rules every quantized linear shares: each ``(name, tensor, dtype)`` in ``dtypes`` has its
    dtype; the weight is [N, K] with K = x_q.shape[-1]; K is at most ``max_k``, beyond which ``why``."""
    for name, t, dtype in dtypes:
        if t.dtype != dtype:
            raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if weight.dim() != 2 or x_q.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: weight must be [N, K] with K = x_q.shape[-1]; got x_q {tuple(x_q.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if x_q.shape[-1] > max_k:
        raise ValueError(
            f"{op}: K={x_q.shape[-1]} exceeds {max_k}, beyond which {why}; split the layer along K"
        )


def gelu_tanh_reference(x: Tensor) -> Tensor:
    """GELU with the tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))``."""
    return contiguous_as(F.gelu(x.float(), approximate="tanh"), x.dtype)


def mul_add_reference(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """``x * y + z`` with broadcasting (a gated residual: ``gate * branch + residual``).

    Computed in fp32 as a rounded multiply followed by a rounded add; the result has the promoted
    dtype of the three inputs.
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    return contiguous_as(x.float() * y.float() + z.float(), dtype)


def _fake_mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape, z.shape), dtype=dtype)


define(
    "gelu_tanh(Tensor x) -> Tensor",
    reference=gelu_tanh_reference,
    fake=lambda x: x.new_empty(x.shape),
    differentiable=True,
)
define(
    "mul_add(Tensor x, Tensor y, Tensor z) -> Tensor",
    reference=mul_add_reference,
    fake=_fake_mul_add,
    differentiable=True,
)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh approximation, computed in fp32."""
    return torch.ops.sdkiln.gelu_tanh.default(x)


def mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """``x * y + z`` with broadcasting, computed in fp32."""
    return torch.ops.sdkiln.mul_add.default(x, y, z)
