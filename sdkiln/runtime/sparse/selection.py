"""Which key blocks each query block keeps: pooled block scores, then top-k or cumulative mass.

Q and K are mean-pooled per block (over the block's real tokens); the pooled query of a block
scores every pooled key block with the attention's own scale, and a softmax over key blocks gives
each one's share of the block-level attention mass. Per (batch, head, query block):

* ``topk`` with sparsity ``s``: keep ``ceil((1 - s) * n)`` of the ``n`` key blocks, the best scores;
* ``mass`` with mass ``m``: keep the fewest best-scoring key blocks whose mass reaches ``m``.

Forced blocks are kept first and count towards the budget: a query block's own key block (the
diagonal, in self-attention) and every ``dense_k`` key block (text, a video's first frame); a
``dense_q`` query block keeps every key block. This is the pure-torch selection the runtime and the
calibration share (``sdkiln.sparsify`` imports it); it runs once per call, or once per
``mask_reuse`` denoising steps, and costs O(n^2 D / block_size^2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pool_blocks(x: Tensor, block_size: int) -> Tensor:
    """[B, S, H, D] -> the per-block mean [B, H, ceil(S / block_size), D] in fp32 (a short last block
    averages its real tokens only)."""
    b, s, h, d = x.shape
    n = math.ceil(s / block_size)
    t = x.float().transpose(1, 2)
    if n * block_size != s:
        t = torch.nn.functional.pad(t, (0, 0, 0, n * block_size - s))
    sums = t.reshape(b, h, n, block_size, d).sum(3)
    counts = torch.full((n,), float(block_size), device=x.device)
    counts[-1] = s - (n - 1) * block_size
    return sums / counts[:, None]


def select_blocks(
    q: Tensor,
    k: Tensor,
    values: Tensor,
    block_size: int,
    selection: str,
    dense_q: Tensor,
    dense_k: Tensor,
    scale: float | None = None,
) -> Tensor:
    """The kept key blocks, int32 [B, H, nq, K] padded with -1 (the ``block_sparse_attention`` op's
    ``kept``), for q [B, Sq, H, D] and k [B, Sk, H, D] in the tiled order. ``values`` [H] is the
    sparsity (``topk``) or mass (``mass``) of each head; ``dense_q`` [nq] and ``dense_k`` [nk] are
    boolean block flags."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qm, km = pool_blocks(q, block_size), pool_blocks(k, block_size)
    nq, nk = qm.shape[2], km.shape[2]
    probs = torch.softmax(qm @ km.transpose(-1, -2) * scale, dim=-1)  # [B, H, nq, nk]
    forced = dense_k.to(q.device)[None, None, None, :].expand_as(probs).clone()
    if nq == nk:
        forced |= torch.eye(nq, dtype=torch.bool, device=q.device)
    ranked = torch.where(forced, 2.0, probs)  # forced blocks first, then by score
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    n_forced = forced.sum(-1, keepdim=True)
    values = values.to(q.device, torch.float32)[None, :, None, None]
    if selection == "topk":
        budget = torch.ceil((1.0 - values) * nk - 1e-6).long().clamp(min=1)
        count = torch.maximum(budget.expand_as(n_forced), n_forced)
    else:
        mass = probs.gather(-1, order).cumsum(-1)
        count = (mass < values - 1e-6).sum(-1, keepdim=True) + 1
        count = torch.maximum(count.clamp(max=nk), n_forced)
    count = torch.where(dense_q.to(q.device)[None, None, :, None], nk, count)
    rank = torch.arange(nk, device=q.device)
    kept = torch.where(rank < count, order, nk).sort(dim=-1).values
    width = int(count.max())
    kept = kept[..., :width]
    return torch.where(kept == nk, -1, kept).to(torch.int32)


def kept_fraction(kept: Tensor, nk: int) -> float:
    """The fraction of (query block, key block) pairs computed: 1 - the realized sparsity."""
    return float((kept >= 0).sum()) / (kept.shape[0] * kept.shape[1] * kept.shape[2] * nk)
