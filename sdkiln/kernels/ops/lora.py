"""The LoRA branch: ``lora_add(x, lora_a, lora_b, scale, base) = base + ((x @ A^T) * scale) @ B^T``.

A LoRA adapter on a layer is a low-rank branch beside its weight: the shrink ``x @ A^T`` (A: [R, K]),
a per-rank scale (each adapter's strength times its alpha / rank, repeated over its ranks; several
adapters are concatenated along R), the expand ``@ B^T`` (B: [N, R]), added to the layer's output
``base``. On a quantized layer the branch runs in the model's dtype from the layer's unquantized input
(``sdkiln.runtime.lora``). A rank slot whose scale is 0 contributes exactly 0, so padding A and B to a
fixed rank, or switching an adapter off by its scale, leaves ``base`` unchanged bit for bit.

Numerics: fp32 throughout (the shrink, the scale, the expand, the add), one rounding to ``base``'s
dtype at the end, as every float op here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.registry import define

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_lora_add(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> None:
    for name, t in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b), ("base", base)):
        if t.dtype not in FLOATS:
            raise ValueError(f"lora_add: {name} must be a float tensor, got {t.dtype}")
    if scale.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(
            f"lora_add: scale must be a float32 vector [R], got {scale.dtype} {tuple(scale.shape)}"
        )
    rank = scale.shape[0]
    if (
        lora_a.dim() != 2
        or lora_b.dim() != 2
        or lora_a.shape != (rank, x.shape[-1])
        or lora_b.shape[1] != rank
    ):
        raise ValueError(
            f"lora_add: need lora_a [R, K], lora_b [N, R], scale [R] with K = x.shape[-1]; got x "
            f"{tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, scale {tuple(scale.shape)}"
        )
    if base.shape != (*x.shape[:-1], lora_b.shape[0]):
        raise ValueError(
            f"lora_add: base must be {(*x.shape[:-1], lora_b.shape[0])}, got {tuple(base.shape)}"
        )


def lora_add_reference(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> Tensor:
    """``base + ((x @ A^T) * scale) @ B^T`` in fp32, rounded once to ``base``'s dtype."""
    check_lora_add(x, lora_a, lora_b, scale, base)
    shrunk = (x.float() @ lora_a.float().t()) * scale
    return contiguous_as(base.float() + shrunk @ lora_b.float().t(), base.dtype)


define(
    "lora_add(Tensor x, Tensor lora_a, Tensor lora_b, Tensor scale, Tensor base) -> Tensor",
    reference=lora_add_reference,
    fake=lambda x, lora_a, lora_b, scale, base: base.new_empty(base.shape),
    differentiable=False,
)


def lora_add(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> Tensor:
    """``base + ((x @ lora_a^T) * scale) @ lora_b^T``, computed in fp32 (module docstring)."""
    return torch.ops.sdkiln.lora_add.default(x, lora_a, lora_b, scale, base)
