"""``block_sparse_attention`` on the CPU: the kept key blocks gathered, then torch's CPU flash kernel.

The reference (``ops/sparse_attention.py``) already computes only the kept blocks, but materializes
fp32 logits per query block and runs two einsums; this kernel gathers each query block's kept key
and value blocks into one contiguous run and hands (query block, its keys) pairs to
``aten._scaled_dot_product_flash_attention_for_cpu`` as a batch, which tiles, keeps the softmax
online and returns the log-sum-exp the op promises. Query blocks are grouped by how many key blocks
they keep (a dense text block keeps all, a head with less sparsity keeps more), one flash call per
group, so no padding key is ever computed. A short last block is padded to the block size: padded
queries are cut from the output, padded keys are masked out (a float mask, only in the groups that
hold the last block). Measured against the dense reference and SDPA in ``bench/sparse.py``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sdkiln.kernels.ops.sparse_attention import check_block_sparse_attention
from sdkiln.kernels.registry import register_kernel


def _fits(q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale) -> bool:
    return (
        q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.dtype == k.dtype == v.dtype
        and q.shape[-1] == v.shape[-1]
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


@register_kernel("block_sparse_attention", "cpu", name="flash_gather", priority=10, supports=_fits)
def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None
) -> tuple[Tensor, Tensor]:
    check_block_sparse_attention(q, k, v, kept, block_size)
    b, sq, h, d = q.shape
    sk, bs = k.shape[1], block_size
    nq, nk = kept.shape[2], math.ceil(sk / bs)
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def blocks(t: Tensor, n: int) -> Tensor:  # [B, S, H, D] -> [B*H, n, bs, D], zero-padded
        t = t.transpose(1, 2)
        if n * bs != t.shape[2]:
            t = torch.nn.functional.pad(t, (0, 0, 0, n * bs - t.shape[2]))
        return t.reshape(b * h, n, bs, d)

    qb, kb, vb = blocks(q, nq), blocks(k, nk), blocks(v, nk)
    rows = kept.reshape(b * h * nq, kept.shape[-1]).long()
    counts = (rows >= 0).sum(-1)
    # kept lists are padded at the end or anywhere: order each row's real indices first
    order = torch.where(rows >= 0, rows, nk).sort(dim=-1).values
    out = q.new_zeros(b * h * nq, bs, d)
    lse = torch.full((b * h * nq, bs), -math.inf, dtype=torch.float32)
    short = sk % bs
    for count in counts.unique().tolist():
        if count == 0:
            continue
        sel = (counts == count).nonzero().squeeze(1)
        head, qi = sel // nq, sel % nq
        idx = order[sel, :count]  # [N, count]
        kg = kb[head[:, None], idx].reshape(len(sel), 1, count * bs, d)
        vg = vb[head[:, None], idx].reshape(len(sel), 1, count * bs, d)
        mask = None
        if short and bool((idx == nk - 1).any()):
            pad = (idx == nk - 1)[..., None] & (torch.arange(bs) >= short)  # [N, count, bs]
            mask = torch.zeros(len(sel), 1, 1, count * bs, dtype=q.dtype).masked_fill(
                pad.reshape(len(sel), 1, 1, count * bs), -math.inf
            )
        o, o_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb[head, qi][:, None], kg, vg, 0.0, False, attn_mask=mask, scale=scale
        )
        out[sel] = o[:, 0]
        lse[sel] = o_lse[:, 0].float()
    out = out.reshape(b, h, nq * bs, d)[:, :, :sq].transpose(1, 2).contiguous()
    lse = lse.reshape(b, h, nq * bs)[:, :, :sq].transpose(1, 2).contiguous()
    return out, lse
