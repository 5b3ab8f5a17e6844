"""Scaled dot-product attention that also returns the log-sum-exp, in diffusers' dispatch layout.

q, k and v are [B, S, H, D]: the layout diffusers 0.42's ``dispatch_attention_fn`` passes to every
attention backend (and its context-parallel templates), so the attention seam
(``sdkiln.runtime.attention``) hands tensors over without a transpose. The log-sum-exp is
[B, Sq, H], the shape diffusers' ring attention merges partial results with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.registry import define


def check_attention(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shape rules of ``attention``; shared with its fake."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, _, h, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d) or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            "attention: q [B, Sq, H, D], k [B, Sk, H, D] and v [B, Sk, H, Dv] disagree: "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``softmax(scale * q @ k.T + mask) @ v`` per batch and head, and the log-sum-exp of the logits.

    q [B, Sq, H, D], k [B, Sk, H, D], v [B, Sk, H, Dv]; ``scale`` defaults to 1/sqrt(D). The mask
    broadcasts to [B, H, Sq, Sk], as in ``F.scaled_dot_product_attention``: boolean True means
    "attend", a float mask is added to the scaled logits. Returns ``out`` [B, Sq, H, Dv] in q's
    dtype and ``lse = logsumexp(scale * q @ k.T + mask)`` [B, Sq, H] in fp32 (natural log), the
    quantity needed to merge attention over split keys (ring attention). A query that may attend to
    nothing gets ``out = 0`` and ``lse = -inf``, as SDPA's zeros. Computed in fp32.
    """
    check_attention(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D] views
    logits = (qh @ kh.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    out = (probs @ vh).transpose(1, 2)
    return contiguous_as(out, q.dtype), lse.transpose(1, 2).contiguous()


def _fake_attention(q, k, v, mask, scale) -> tuple[Tensor, Tensor]:
    check_attention(q, k, v)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> (Tensor, Tensor)",
    reference=attention_reference,
    fake=_fake_attention,
    differentiable=True,
)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of [B, S, H, D] tensors: (out [B, Sq, H, Dv] in q's dtype, fp32 lse [B, Sq, H])."""
    return torch.ops.sdkiln.attention.default(q, k, v, mask, scale)
