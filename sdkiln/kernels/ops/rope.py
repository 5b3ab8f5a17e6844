"""Rotary position embedding, both conventions diffusers uses."""

from __future__ import annotations

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import check_broadcast, contiguous_as
from sdkiln.kernels.registry import define


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
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
    return contiguous_as(y, x.dtype)


def _fake_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    check_broadcast("rope", x, cos, sin)
    return x.new_empty(x.shape)


define(
    "rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor",
    reference=rope_reference,
    fake=_fake_rope,
    differentiable=True,
)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = True) -> Tensor:
    """Rotary embedding of x [B, H, S, D] by cos/sin [S, D]; interleaved pairs or rotate-half."""
    return torch.ops.sdkiln.rope.default(x, cos, sin, interleaved)
