"""The LoRA branch's Triton kernel (``lora_add``): the shrink, the per-rank scale, the expand and the add
to the layer's output in one launch.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output: it shrinks its BLOCK_M rows of x to the
rank (``x @ A^T`` over K in BLOCK_K steps, fp32 accumulation), scales, expands the [BLOCK_M, R] result
by its BLOCK_N columns of B and adds the base tile, rounding once on the store. The rank is padded to a
power of two of at least 16 (``tl.dot``'s smallest side); the shrink is recomputed per column tile,
which costs R/BLOCK_N of the expand's work at most: LoRA ranks are small (4 to 128) against N.
Half operands enter ``tl.dot`` in their own dtype (tensor cores), the scaled shrink in B's dtype; fp32
operands, and every operand under Triton's interpreter (whose half ``tl.dot`` is wrong), as fp32 with
IEEE precision, as the GEMM does. Tuning the tile sizes is GPU work (issue 38).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from sdkiln.kernels.ops.lora import check_lora_add
from sdkiln.kernels.registry import register_kernel
from sdkiln.kernels.triton.configs import INTERPRET, KERNEL_NAME
from sdkiln.kernels.triton.rounding import rounded
from sdkiln.kernels.triton.rows import FLOATS

MAX_RANK = 256
"""Ranks above this run the reference (the [BLOCK_M, R] shrink lives in registers)."""
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _lora_add(
    x_ptr, a_ptr, b_ptr, s_ptr, base_ptr, out_ptr, M, N, K, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0
        )
        a_t = tl.load(
            a_ptr + ranks[None, :] * K + ks[:, None], mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0
        )
        if FP32_DOT:
            shrunk += tl.dot(x.to(tl.float32), a_t.to(tl.float32), input_precision="ieee")
        else:
            shrunk += tl.dot(x, a_t)
    scale = tl.load(s_ptr + ranks, mask=ranks < R, other=0.0)
    shrunk = shrunk * scale[None, :]
    b_t = tl.load(
        b_ptr + cols[None, :] * R + ranks[:, None], mask=(ranks[:, None] < R) & (cols[None, :] < N), other=0.0
    )
    if FP32_DOT:
        branch = tl.dot(shrunk, b_t.to(tl.float32), input_precision="ieee")
    else:
        branch = tl.dot(shrunk.to(b_t.dtype), b_t)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    base = tl.load(base_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, rounded(base + branch, out_ptr.dtype.element_ty), mask=inside)


@triton_op("sdkiln_triton::lora_add", mutates_args=())
def lora_add(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> Tensor:
    check_lora_add(x, lora_a, lora_b, scale, base)
    k, (n, r) = x.shape[-1], lora_b.shape
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    m = x2.shape[0]
    if m and n:
        block_r = max(16, triton.next_power_of_2(r))
        wrap_triton(_lora_add)[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            x2, lora_a.contiguous(), lora_b.contiguous(), scale.contiguous(), base.contiguous(), out, m, n, k, r,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=block_r,
            FP32_DOT=INTERPRET or x.dtype == torch.float32,
        )  # fmt: skip
    return out


def _fits(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> bool:
    return (
        x.dtype in FLOATS
        and lora_a.dtype == lora_b.dtype == x.dtype
        and base.dtype in FLOATS
        and 0 < scale.shape[0] <= MAX_RANK
    )


register_kernel("lora_add", "cuda", KERNEL_NAME, supports=_fits)(lora_add)
