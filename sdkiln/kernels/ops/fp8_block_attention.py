"""FP8 block-quantized attention in MindIE SD's arithmetic (its ``FP8RotateQuantFA``): the form Ascend
runs, so that a plan calibrated with this op measured what the NPU will compute.

``fp8_block_attention(q, k, v, mask, scale, rotate)``, q, k, v [B, S, H, D] (diffusers' dispatch layout,
as ``attention``), returns out [B, Sq, H, Dv] in q's dtype. In order:

1. **Rotate** (``rotate``): ``q @ R`` and ``k @ R`` in fp32 with ``R`` the orthonormal Walsh-Hadamard
   matrix of order D, rounded back to q's dtype (MindIE SD multiplies by the exported ``q_rot``/``k_rot``
   in the model's dtype).
2. **Quantize** Q per block of ``Q_ROWS`` (128) tokens and K, V per block of ``KV_ROWS`` (256) tokens, each
   by ``COLUMNS`` (128) channels, per batch row and head: ``scale = absmax(block) / 448`` (1 for a block of
   zeros), values the e4m3fn of ``x / scale`` clamped to ±448 (``npu_dynamic_block_quant``'s contract as
   MindIE SD calls it). No K smoothing: MindIE SD has none.
3. **Attention** of the dequantized values in fp32 (``scaled_dot_product_attention``; with a mask, the
   ``attention`` reference: boolean True attends, a float mask adds, a row that attends to nothing gets
   0), then rounded to q's dtype. P is not quantized: how the NPU rounds it inside
   ``npu_fused_infer_attention_score_v2`` (quant modes 7) is not documented, so the contract keeps it
   exact and the Ascend emulation does the same (``docs/ascend.md``).

No log-sum-exp is returned: the NPU call gives none in this mode, and nothing that needs one (ring
attention) runs a quantized plan.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sdkiln.kernels.ops.attention import attention_reference, check_attention
from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.ops.fp8 import FP8_E4M3_MAX
from sdkiln.kernels.ops.quantized_attention import hadamard
from sdkiln.kernels.registry import define

Q_ROWS = 128
KV_ROWS = 256
COLUMNS = 128


def check_fp8_block_attention(q: Tensor, k: Tensor, v: Tensor, rotate: bool) -> None:
    """Argument rules of ``fp8_block_attention``; shared with its fake."""
    check_attention(q, k, v)
    d = q.shape[-1]
    if rotate and (d < 1 or d & (d - 1)):
        raise ValueError(
            f"fp8_block_attention: a Hadamard rotation needs a power-of-two head dimension, got {d}"
        )


def rotated(x: Tensor, rotate: bool) -> Tensor:
    """Step 1 on [..., D]: ``(x @ R)`` in fp32, in x's dtype (x itself without ``rotate``)."""
    if not rotate:
        return x
    return (x.float() @ hadamard(x.shape[-1], x.device)).to(x.dtype)


def block_quantize(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Step 2 on [..., R, C]: (e4m3fn values of x's shape, fp32 scales [..., ceil(R / rows), ceil(C / 128)])."""
    *_, r, c = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, (-c) % COLUMNS, 0, (-r) % rows))
    blocks = padded.unflatten(-1, (-1, COLUMNS)).unflatten(-3, (-1, rows))  # [..., R/rows, rows, C/128, 128]
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    values = values.to(torch.float8_e4m3fn).flatten(-2).flatten(-3, -2)[..., :r, :c]
    return values, scale


def block_dequantize(values: Tensor, scale: Tensor, rows: int) -> Tensor:
    """The fp32 values ``values * scale`` of ``block_quantize``'s output."""
    *_, r, c = values.shape
    expanded = scale.repeat_interleave(rows, dim=-2).repeat_interleave(COLUMNS, dim=-1)[..., :r, :c]
    return values.float() * expanded


def fp8_block_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, rotate: bool
) -> Tensor:
    """The module docstring's steps, in its order."""
    check_fp8_block_attention(q, k, v, rotate)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (t.transpose(1, 2) for t in (rotated(q, rotate), rotated(k, rotate), v))  # [B, H, S, D]
    qd, kd, vd = (
        block_dequantize(*block_quantize(t, rows), rows)
        for t, rows in ((qh, Q_ROWS), (kh, KV_ROWS), (vh, KV_ROWS))
    )
    if mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale).transpose(1, 2)
    else:
        out, _ = attention_reference(*(t.transpose(1, 2) for t in (qd, kd, vd)), mask, scale)
    return contiguous_as(out, q.dtype)


def _fake(q, k, v, mask, scale, rotate) -> Tensor:
    check_fp8_block_attention(q, k, v, rotate)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


define(
    "fp8_block_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, bool rotate) -> Tensor",
    reference=fp8_block_attention_reference,
    fake=_fake,
    differentiable=False,
)


def fp8_block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    rotate: bool = False,
) -> Tensor:
    """FP8 block-quantized attention of [B, S, H, D] tensors in MindIE SD's arithmetic (module docstring)."""
    return torch.ops.sdkiln.fp8_block_attention.default(q, k, v, mask, scale, rotate)
