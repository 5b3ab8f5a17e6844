"""Block-sparse attention: each (batch, head, query block) attends only to the key blocks it keeps.

Same layout as ``attention`` (q, k, v [B, S, H, D]; out [B, Sq, H, Dv]; fp32 lse [B, Sq, H]). The
sequence is cut into blocks of ``block_size`` tokens (the last block may be short);
``kept`` [B, H, ceil(Sq / block_size), K] int32 lists, per query block, the distinct key block
indices it attends to, padded with -1. Which blocks to keep is the sparse-attention plan's
business (``sparsify``); this op only computes them, and only them: its reference gathers the kept
key blocks, so its cost falls with the sparsity as a kernel's does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sdkiln.kernels.ops.attention import check_attention
from sdkiln.kernels.ops.elementwise import contiguous_as
from sdkiln.kernels.registry import define


def check_block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, values: bool = True
) -> None:
    """Shape rules, and with ``values`` the block indices themselves (read from the device: the
    fake, which has no values, checks shapes only)."""
    check_attention(q, k, v)
    if block_size < 1:
        raise ValueError(f"block_sparse_attention: block_size must be positive, got {block_size}")
    b, sq, h, _ = q.shape
    nq, nk = math.ceil(sq / block_size), math.ceil(k.shape[1] / block_size)
    if kept.dtype != torch.int32 or kept.dim() != 4 or tuple(kept.shape[:3]) != (b, h, nq):
        raise ValueError(
            f"block_sparse_attention: kept must be int32 [B={b}, H={h}, query blocks={nq}, K], got "
            f"{kept.dtype} {tuple(kept.shape)}"
        )
    if values and kept.numel():
        if int(kept.max()) >= nk or int(kept.min()) < -1:
            raise ValueError(f"block_sparse_attention: kept holds block indices in [0, {nk}) or -1 (padding)")
        ordered = kept.sort(dim=-1).values
        if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
            raise ValueError("block_sparse_attention: a query block lists the same key block twice")


def block_sparse_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``attention`` restricted to the kept key blocks: (out [B, Sq, H, Dv] in q's dtype, fp32 lse
    [B, Sq, H]). A query block that keeps nothing gets out 0 and lse -inf. Computed in fp32 over the
    gathered blocks only."""
    check_block_sparse_attention(q, k, v, kept, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, sq, h, _ = q.shape
    sk, bs = k.shape[1], block_size
    nq, nk = kept.shape[2], math.ceil(sk / bs)

    def blocks(t: Tensor, n: int) -> Tensor:  # [B, S, H, D] -> [B, H, n, bs, D], zero-padded
        t = t.float().transpose(1, 2)
        t = torch.nn.functional.pad(t, (0, 0, 0, n * bs - t.shape[2]))
        return t.reshape(b, h, n, bs, t.shape[-1])

    qb, kb, vb = blocks(q, nq), blocks(k, nk), blocks(v, nk)
    idx = kept.long().clamp(min=0)
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = torch.arange(h, device=q.device)[None, :, None, None]
    kg, vg = kb[bi, hi, idx], vb[bi, hi, idx]  # [B, H, nq, K, bs, D]
    logits = torch.einsum("bhqid,bhqkjd->bhqikj", qb, kg) * scale
    key_pos = idx[..., None] * bs + torch.arange(bs, device=q.device)
    valid = (kept[..., None] >= 0) & (key_pos < sk)  # [B, H, nq, K, bs]
    logits = logits.masked_fill(~valid[:, :, :, None], -math.inf).flatten(-2)  # [B, H, nq, bs, K*bs]
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    out = torch.einsum("bhqik,bhqkd->bhqid", probs, vg.flatten(3, 4))
    out = out.reshape(b, h, nq * bs, -1)[:, :, :sq].transpose(1, 2)
    lse = lse.reshape(b, h, nq * bs)[:, :, :sq].transpose(1, 2)
    return contiguous_as(out, q.dtype), lse.contiguous()


def _fake_block_sparse_attention(q, k, v, kept, block_size, scale) -> tuple[Tensor, Tensor]:
    check_block_sparse_attention(q, k, v, kept, block_size, values=False)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


define(
    "block_sparse_attention(Tensor q, Tensor k, Tensor v, Tensor kept, int block_size, float? scale) "
    "-> (Tensor, Tensor)",
    reference=block_sparse_attention_reference,
    fake=_fake_block_sparse_attention,
    differentiable=False,
)


def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of [B, S, H, D] tensors over the kept key blocks only: (out, fp32 lse [B, Sq, H])."""
    return torch.ops.sdkiln.block_sparse_attention.default(q, k, v, kept, block_size, scale)


def dense_mask(kept: Tensor, block_size: int, sq: int, sk: int) -> Tensor:
    """The boolean [B, H, Sq, Sk] mask that ``kept`` stands for (True attends): what
    ``attention`` with this mask computes, ``block_sparse_attention`` computes from ``kept``."""
    b, h, nq, _ = kept.shape
    nk = math.ceil(sk / block_size)
    blocks = torch.zeros(b, h, nq, nk + 1, dtype=torch.bool, device=kept.device)
    blocks.scatter_(-1, torch.where(kept >= 0, kept.long(), nk), True)
    mask = blocks[..., :nk].repeat_interleave(block_size, 2).repeat_interleave(block_size, 3)
    return mask[:, :, :sq, :sk]
