"""Attention on Ascend: ``attention`` on ``npu_fusion_attention``, ``block_sparse_attention`` on
``npu_block_sparse_attention`` or, where that op is missing or does not fit, on
``npu_fusion_attention`` with the equivalent dense mask.

Imported only by ``load_device_kernels("npu")`` (through ``sdkiln.kernels.npu``). The kernels keep
the reference's contract: q, k, v [B, S, H, D] in; out [B, Sq, H, Dv] in q's dtype and a float32
natural-log lse [B, Sq, H] out; a query that may attend to nothing gets out 0 and lse -inf. What the
torch_npu ops cannot take goes to the reference through ``supports()``.

* ``npu_fusion_attention(q, k, v, H, "BSND", atten_mask=..., scale=...)`` takes our layout as it is.
  Its default scale is 1.0, so the scale is always passed. Its ``atten_mask`` is boolean with True
  = masked out (ours: True = attend), in one of the shapes [B, H, Sq, Sk], [B, 1, Sq, Sk],
  [1, 1, Sq, Sk]: our mask is inverted and expanded to the smallest of these. Float (additive)
  masks run the reference. The lse is ``softmax_max + log(softmax_sum)``: the op returns the row
  max of the scaled logits and the row sum of ``exp(logit - max)`` as float32 [B, H, Sq, 8], the
  value repeated eight times (shape from torch_npu's meta registration, contents from op-plugin's
  own test of its backward, which builds them that way; the API reference describes them only as
  the softmax's max and sum). Fully masked rows have no documented result ("precision may
  degrade"), so they are set to 0 / -inf afterwards.
* ``npu_block_sparse_attention`` (torch_npu 26.0.0 and later, Atlas A2/A3) takes the kept lists as
  an int8 [B, H, query blocks, key blocks] mask with ``block_shape=[block, block]``; it documents a
  key block that is a multiple of 128, head dims 64 or 128 and K, V of one shape. It takes BNSD
  (or TND with per-batch lengths), so q, k, v are transposed to [B, H, S, D] copies and the output
  back. ``inner_precise=0`` (float32 softmax intermediates, the only mode for bfloat16);
  ``softmax_lse_flag=1`` for the lse [B, H, Sq, 1]. Query blocks that keep nothing are set to
  0 / -inf afterwards, the op's result there being undocumented.
* Elsewhere ``block_sparse_attention`` is ``npu_fusion_attention`` with ``dense_mask(kept)``: correct,
  but dense in compute and with a [B, H, Sq, Sk] mask in memory, not sparse-fast.

Both ops compute in float16 or bfloat16 here; torch_npu 7.1 and later also document float32 for
``npu_fusion_attention``, earlier references do not, so float32 runs the reference.
``npu_fusion_attention``'s reference lists it for training; diffusers' NPU attention backend
calls it for inference too, as we do. None of this has run on Ascend hardware (``docs/ascend.md``).
"""

from __future__ import annotations

import math

import torch
import torch_npu
from torch import Tensor

from sdkiln.kernels.npu.quant import HALF_DTYPES, KERNEL_NAME
from sdkiln.kernels.ops.attention import check_attention
from sdkiln.kernels.ops.sparse_attention import check_block_sparse_attention, dense_mask
from sdkiln.kernels.registry import register_kernel

DENSE_MASK_KERNEL_NAME = "torch_npu_dense_mask"
FUSION_MAX_HEAD_DIM = 768  # npu_fusion_attention: D in [1, 768], Dv <= D
BLOCK_SPARSE_HEAD_DIMS = (64, 128)  # npu_block_sparse_attention forward
BLOCK_SPARSE_KV_BLOCK_MULTIPLE = 128


def _fits_fusion(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return (
        q.dim() == k.dim() == v.dim() == 4
        and q.dtype in HALF_DTYPES
        and k.dtype == v.dtype == q.dtype
        and v.shape[-1] <= q.shape[-1] <= FUSION_MAX_HEAD_DIM
    )


def _fusion_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float | None):
    """``npu_fusion_attention`` in BSND with ``keep`` (True = attend, broadcasting to [B, H, Sq, Sk])."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    atten_mask = None
    if keep is not None:
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        shape = (
            (b, h, sq, sk) if keep.shape[1] != 1 else (b, 1, sq, sk) if keep.shape[0] != 1 else (1, 1, sq, sk)
        )
        atten_mask = (~keep.expand(shape)).contiguous()
    out, softmax_max, softmax_sum, *_ = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        h,
        "BSND",
        atten_mask=atten_mask,
        scale=1.0 / math.sqrt(d) if scale is None else scale,
    )
    lse = softmax_max[..., 0] + torch.log(softmax_sum[..., 0])  # [B, H, Sq]
    if keep is not None:
        empty = ~keep.any(dim=-1)  # [B|1, H|1, Sq|1]
        out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0)
        lse = lse.masked_fill(empty, -math.inf)
    return out.contiguous(), lse.transpose(1, 2).contiguous()


@register_kernel(
    "attention",
    "npu",
    name=KERNEL_NAME,
    supports=lambda q, k, v, mask, scale: (
        _fits_fusion(q, k, v) and (mask is None or (mask.dtype == torch.bool and mask.dim() <= 4))
    ),
)
def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``npu_fusion_attention`` in BSND, a boolean mask inverted into ``atten_mask``."""
    check_attention(q, k, v)
    return _fusion_attention(q, k, v, mask, scale)


def _fits_block_sparse(q: Tensor, k: Tensor, v: Tensor, block_size: int) -> bool:
    return (
        getattr(torch_npu, "npu_block_sparse_attention", None) is not None
        and q.dim() == k.dim() == v.dim() == 4
        and q.dtype in HALF_DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] in BLOCK_SPARSE_HEAD_DIMS
        and k.shape == v.shape
        and block_size > 0
        and block_size % BLOCK_SPARSE_KV_BLOCK_MULTIPLE == 0
    )


@register_kernel(
    "block_sparse_attention",
    "npu",
    name=KERNEL_NAME,
    supports=lambda q, k, v, kept, block_size, scale: _fits_block_sparse(q, k, v, block_size),
)
def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``npu_block_sparse_attention`` in BNSD with the kept lists as an int8 block mask."""
    check_block_sparse_attention(q, k, v, kept, block_size)
    b, sq, h, d = q.shape
    nk = math.ceil(k.shape[1] / block_size)
    blocks = torch.zeros(*kept.shape[:3], nk + 1, dtype=torch.int8, device=kept.device)
    blocks.scatter_(-1, torch.where(kept >= 0, kept.long(), nk), 1)  # -1 padding lands in the extra column
    out, lse = torch_npu.npu_block_sparse_attention(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        blocks[..., :nk].contiguous(),
        [block_size, block_size],
        q_input_layout="BNSD",
        kv_input_layout="BNSD",
        num_key_value_heads=h,
        scale_value=1.0 / math.sqrt(d) if scale is None else scale,
        inner_precise=0,
        softmax_lse_flag=1,
    )
    empty = (kept < 0).all(dim=-1).repeat_interleave(block_size, dim=2)[:, :, :sq]  # [B, H, Sq]
    out = out.masked_fill(empty.unsqueeze(-1), 0.0).transpose(1, 2).contiguous()
    return out, lse[..., 0].masked_fill(empty, -math.inf).transpose(1, 2).contiguous()


@register_kernel(
    "block_sparse_attention",
    "npu",
    name=DENSE_MASK_KERNEL_NAME,
    priority=-1,
    supports=lambda q, k, v, kept, block_size, scale: _fits_fusion(q, k, v),
)
def block_sparse_attention_dense_mask(
    q: Tensor, k: Tensor, v: Tensor, kept: Tensor, block_size: int, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``npu_fusion_attention`` with ``dense_mask(kept)``: what the kept blocks stand for, computed densely."""
    check_block_sparse_attention(q, k, v, kept, block_size)
    return _fusion_attention(q, k, v, dense_mask(kept, block_size, q.shape[1], k.shape[1]), scale)


FA_FP8_MAX_HEAD_DIM = 128  # one 128-channel scale column per row block (MindIE SD's FP8RotateQuantFA)


def _fits_fp8_block(q: Tensor, k: Tensor, v: Tensor, mask, scale, rotate) -> bool:
    return (
        mask is None
        and q.dim() == k.dim() == v.dim() == 4
        and q.dtype in HALF_DTYPES
        and k.dtype == v.dtype == q.dtype
        and k.shape == v.shape
        and q.shape[2] == k.shape[2]
        and q.shape[-1] <= FA_FP8_MAX_HEAD_DIM
    )


@register_kernel("fp8_block_attention", "npu", name=KERNEL_NAME, supports=_fits_fp8_block)
def fp8_block_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, rotate: bool
) -> Tensor:
    """MindIE SD's ``FP8RotateQuantFA`` (``mindiesd/quantization/layer.py``, ``docs/ascend.md``): Q and K
    rotated (``fp8_block_attention.rotated``), each batch row's Q, K, V in BNSD quantized by
    ``npu_dynamic_block_quant`` (128 query rows, 256 key and value rows, by 128 channels), then
    ``npu_fused_infer_attention_score_v2`` with the quant modes 7. CANN documents those modes for
    Ascend 950 only; MindIE SD, like this kernel, calls the quantization one batch row at a time."""
    from sdkiln.kernels.ops.fp8_block_attention import KV_ROWS, Q_ROWS, check_fp8_block_attention, rotated

    check_fp8_block_attention(q, k, v, rotate)
    heads, d = q.shape[2], q.shape[-1]
    qh, kh, vh = (t.transpose(1, 2) for t in (rotated(q, rotate), rotated(k, rotate), v))  # BNSD
    outs = []
    for b in range(q.shape[0]):
        (q8, qs), (k8, ks), (v8, vs) = (
            torch_npu.npu_dynamic_block_quant(
                t[b].contiguous(), dst_type=torch.float8_e4m3fn, row_block_size=rows, col_block_size=128
            )
            for t, rows in ((qh, Q_ROWS), (kh, KV_ROWS), (vh, KV_ROWS))
        )
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(
            q8[None], k8[None], v8[None], input_layout="BNSD", num_query_heads=heads,
            softmax_scale=1.0 / math.sqrt(d) if scale is None else scale, query_quant_mode=7, key_quant_mode=7,
            value_quant_mode=7, dequant_scale_query=qs[None], dequant_scale_key=ks[None],
            dequant_scale_value=vs[None], out_dtype=q.dtype,
        )  # fmt: skip
        outs.append(out)
    return torch.cat(outs).transpose(1, 2).contiguous()
