"""Scales stored so that every deployment computes with the values we measured.

MindIE SD casts some of a package's float32 scales to the type the model runs in before use
(``docs/ascend.md``): weight scales and SmoothQuant multipliers to bfloat16 or float16, W8A8's
activation scale to bfloat16, and for float16 output CANN keeps only the top 19 bits of
``deq_scale`` (``aclnnTransQuantParam``: ``scale & 0xFFFFE000``). A scale that those casts change
makes the NPU compute a different layer from the one our runtime ran and the quality report
measured. So the quantizers store each such scale on a grid the casts leave unchanged:

* ``half_exact``: representable in both bfloat16 and float16 (8 significant bits, a multiple of
  2**-24, at most 65504), rounded up where the scale bounds a range (no value that fitted
  before is clipped after) and to nearest where it only scales;
* ``fp19_nearest``: representable with 10 mantissa bits (``deq_scale``).

The grids cost nothing measurable: a step at most 0.4% (bfloat16) or 0.05% (fp19) coarser.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # float16's smallest subnormal: every float16 is a multiple of it
_BF16_DROPPED = 0xFFFF  # the low 16 bits of a float32 that bfloat16 does not keep
_FP19_DROPPED = 0x1FFF  # the low 13 bits that CANN's fp19 does not keep


def _round_bits(x: Tensor, dropped: int, up: bool) -> Tensor:
    """Positive finite float32 ``x`` with the ``dropped`` low bits cleared, rounding up or to nearest."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    bits = bits + (dropped if up else (dropped + 1) // 2)
    return (bits & ~dropped).to(torch.int32).view(torch.float32)


def half_exact(x: Tensor, *, up: bool) -> Tensor:
    """``x`` (positive) as float32 values that bfloat16 and float16 both represent exactly.

    Rounded up (``up=True``) or to nearest at 8 significant bits, then onto float16's subnormal
    grid (multiples of 2**-24) below 2**-14; at least 2**-24. ValueError above float16's range.
    """
    x = x.detach().float()
    if not bool((x > 0).all()) or not bool(torch.isfinite(x).all()):
        raise ValueError("a scale must be positive and finite")
    y = _round_bits(x, _BF16_DROPPED, up)
    grid = (torch.ceil if up else torch.round)(y / FP16_TINY) * FP16_TINY  # exact: powers of two
    y = torch.where(y < 2.0**-14, grid, y).clamp_min(FP16_TINY)
    if bool((y > FP16_MAX).any()):
        raise ValueError(
            f"a scale of {float(y.max()):.4g} is beyond float16's range ({FP16_MAX}); the layer's values "
            "are too large to quantize for a float16 or bfloat16 deployment"
        )
    return y


def fp19_nearest(x: Tensor) -> Tensor:
    """Positive float32 ``x`` rounded to nearest with 10 mantissa bits: what CANN's int64
    ``deq_scale`` keeps, so the truncation it applies changes nothing."""
    return _round_bits(x.detach().float(), _FP19_DROPPED, up=False)
