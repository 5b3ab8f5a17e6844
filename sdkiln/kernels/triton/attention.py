"""Flash attention (forward) returning the log-sum-exp, and block-sparse attention.

One kernel, ``_attention``: a program per (query block, batch x head) keeps its query tile in
registers and streams key/value tiles through an online softmax in fp32 (running max, running sum,
rescaled accumulator), then writes ``out`` [B, Sq, H, Dv] and ``lse`` [B, Sq, H] (natural log) in
the attention seam's layout, read and written with the tensors' own strides, so diffusers'
[B, S, H, D] tensors need no transpose. Dense, it visits every key tile; ``SPARSE``, it visits only
the key blocks listed for its (batch, head, query block) in ``kept`` (-1 entries skipped), with the
kernel's key tile equal to the plan's block size. Masks are not taken: a masked call runs the
reference (diffusers' FLUX, SD3 and Wan transformers call attention without one).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.attention import check_attention
from sdkiln.kernels.ops.sparse_attention import check_block_sparse_attention
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.configs import INTERPRET, KERNEL_NAME, attention_config
from sdkiln.kernels.triton.rounding import rounded
from sdkiln.kernels.triton.rows import FLOATS

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the kernel takes (FLUX, SD3, Wan: 64 or 128); 256 would need smaller tiles than the
configs hold, so it runs the reference."""
SPARSE_BLOCKS = (16, 32, 64, 128)


@triton.jit
def _attention(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kept_ptr,
    H, Sq, Sk, n_kept, scale_log2e,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    D: tl.constexpr, DV: tl.constexpr, SPARSE: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    qblock = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # offsets in int64: B * S * H * D passes 2**31 for long videos
    h = (bh % H).to(tl.int64)
    rm = (qblock * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rd = tl.arange(0, D)
    rdv = tl.arange(0, DV)
    m_in = rm < Sq
    q = tl.load(q_ptr + b * sqb + h * sqh + rm[:, None] * sqs + rd[None, :], mask=m_in[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DV), tl.float32)
    n_steps = n_kept if SPARSE else tl.cdiv(Sk, BLOCK_N)
    for step in range(0, n_steps):
        if SPARSE:
            kb = tl.load(kept_ptr + (bh * tl.cdiv(Sq, BLOCK_M) + qblock) * n_kept + step)
        else:
            kb = step
        if kb >= 0:
            rn = (kb * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            n_in = rn < Sk
            k = tl.load(
                k_ptr + b * skb + h * skh + rn[None, :] * sks + rd[:, None], mask=n_in[None, :], other=0.0
            )
            v = tl.load(
                v_ptr + b * svb + h * svh + rn[:, None] * svs + rdv[None, :], mask=n_in[:, None], other=0.0
            )
            if FP32_DOT:
                s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = tl.where(n_in[None, :], s * scale_log2e, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(s, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.math.exp2(s - safe_max[:, None])
            alpha = tl.math.exp2(running_max - safe_max)
            running_sum = running_sum * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            running_max = new_max
    empty = running_sum == 0.0
    out = acc / tl.where(empty, 1.0, running_sum)[:, None]
    lse = tl.where(
        empty,
        float("-inf"),
        (running_max + tl.math.log2(tl.where(empty, 1.0, running_sum))) * 0.6931471805599453,
    )
    tl.store(
        o_ptr + b * sob + h * soh + rm[:, None] * sos + rdv[None, :],
        rounded(out, o_ptr.dtype.element_ty),
        mask=m_in[:, None],
    )
    tl.store(lse_ptr + (b * Sq + rm) * H + h, lse, mask=m_in)


def _launch(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor | None, block: int | None, scale
) -> tuple[Tensor, Tensor]:
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty((b, sq, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, sq, h), dtype=torch.float32, device=q.device)
    config = attention_config(max(d, dv), block)
    block_m = config.pop("BLOCK_M")
    kept_arg = kept.contiguous() if kept is not None else lse
    if b and sq and h:
        wrap_triton(_attention)[(triton.cdiv(sq, block_m), b * h)](
            q, k, v, out, lse, kept_arg, h, sq, sk, kept.shape[-1] if kept is not None else 0, scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            D=d, DV=dv, SPARSE=kept is not None, FP32_DOT=INTERPRET or q.dtype == torch.float32,
            BLOCK_M=block_m, **config,
        )  # fmt: skip
    return out, lse


@triton_op("sdkiln_triton::attention", mutates_args=())
def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    check_attention(q, k, v)
    return _launch(q, k, v, None, None, scale)


@triton_op("sdkiln_triton::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None
) -> tuple[Tensor, Tensor]:
    # shapes only: reading the indices back would sync the device (and break CUDA-graph capture);
    # an index past the last block reads nothing (every load is masked by the sequence length)
    check_block_sparse_attention(q, k, v, kept, block_size, values=False)
    return _launch(q, k, v, kept, block_size, scale)


def _fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return (
        q.dtype in FLOATS
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and v.shape[-1] in HEAD_DIMS
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )


register_kernel(
    "attention", "cuda", KERNEL_NAME, supports=lambda q, k, v, mask, scale: mask is None and _fits(q, k, v)
)(attention)
register_kernel(
    "block_sparse_attention",
    "cuda",
    KERNEL_NAME,
    supports=lambda q, k, v, kept, block, scale: block in SPARSE_BLOCKS and _fits(q, k, v),
)(block_sparse_attention)
