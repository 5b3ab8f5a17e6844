"""Normalizations: ``rms_norm`` and ``layer_norm_modulate`` (the adaLN modulation of DiT/FLUX blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sdkiln.kernels.ops.elementwise import check_broadcast, contiguous_as
from sdkiln.kernels.registry import define


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last axis."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return contiguous_as(y, x.dtype)


def per_sample(mod: Tensor, x: Tensor) -> Tensor:
    """A [B, D] modulation of a [B, S, D] input applies to every token of sample b."""
    return mod.unsqueeze(1) if x.dim() == 3 and mod.dim() == 2 else mod


def layer_norm_modulate_reference(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """``LayerNorm(x, no affine) * (1 + scale) + shift``.

    For x [B, S, D], scale and shift are [B, D] (one row per sample) or anything that broadcasts
    against x, such as [B, 1, D].
    """
    scale, shift = per_sample(scale, x), per_sample(shift, x)
    check_broadcast("layer_norm_modulate", x, scale, shift)
    y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    y = y * (1 + scale.float()) + shift.float()
    return contiguous_as(y, x.dtype)


def _fake_layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    check_broadcast("layer_norm_modulate", x, per_sample(scale, x), per_sample(shift, x))
    return x.new_empty(x.shape)


define(
    "rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor",
    reference=rms_norm_reference,
    fake=lambda x, weight, eps: x.new_empty(x.shape),
    differentiable=True,
)
define(
    "layer_norm_modulate(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor",
    reference=layer_norm_modulate_reference,
    fake=_fake_layer_norm_modulate,
    differentiable=True,
)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last axis, computed in fp32."""
    return torch.ops.sdkiln.rms_norm.default(x, weight, eps)


def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float = 1e-6) -> Tensor:
    """``LayerNorm(x) * (1 + scale) + shift``; scale/shift [B, D] or broadcasting against x."""
    return torch.ops.sdkiln.layer_norm_modulate.default(x, scale, shift, eps)
