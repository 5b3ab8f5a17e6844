"""The float ``sdkiln`` ops on Ascend (norms, rotary embedding, GELU, the gated residual) and the
norm + per-token int8 pairs, on torch_npu's fused ops or on aten ops that torch_npu runs as one
aclnn kernel each.

Imported only by ``load_device_kernels("npu")`` (through ``sdkiln.kernels.npu``). Each function takes
its op schema's arguments in order and keeps the reference's contract (shape, dtype, contiguous
output). What torch_npu cannot take goes to the reference through ``supports()``; the int8 pairs,
like ``quantize_per_token_int8``, raise for float32 activations instead. Where the reference
computes in float32 and rounds once, these kernels compute in the activation's dtype wherever
torch_npu does (its internal precision is not documented): the difference is one or two roundings
of that dtype, within the tolerance ``tests/kernels/test_npu_mapping.py`` states.

* ``rms_norm``: ``npu_rms_norm(x, gamma, epsilon)[0]``. gamma is required: a ones vector in x's
  dtype stands in for ``weight=None``. A weight of another dtype goes in as float32, a pairing
  documented for Atlas A2/A3 only (the older products take gamma in x's dtype).
* ``layer_norm_modulate``: torch_npu has no adaLN op (MindIE SD's ``layernorm_scale_shift`` calls
  CANN's ``aclnnAdaLayerNorm`` through its own extension, not torch_npu). When scale and shift are
  the same for every token of a sample ([B, D], [B, 1, D]: DiT, FLUX, SD3), the modulation is the
  LayerNorm's affine: ``F.layer_norm(x[b], weight=1 + scale[b], bias=shift[b])``, one kernel per
  sample (torch_npu runs ``layer_norm`` as ``aclnnLayerNorm``); ``npu_layer_norm_eval`` is not used,
  its reference marks it for removal in favour of ``F.layer_norm``. Token-wise modulation is
  ``F.layer_norm`` followed by ``torch.addcmul`` (``aclnnAddcmul``): two kernels.
* ``rope``: ``npu_rotary_mul(x, cos, sin)`` ("half" mode, rotate-half) or with
  ``rotary_mode="interleave"`` (torch_npu 7.0.0 and later; 6.0's signature has no mode). cos/sin
  are viewed as 4-D and must have one of the documented broadcast shapes for x's layout
  (``ROPE_TABLES``); x and cos/sin are cast to their promoted dtype, as MindIE SD casts x to
  cos's dtype, so float32 tables compute in float32 as the reference does.
* ``gelu_tanh``: ``npu_gelu(x, approximate="tanh")``. Not ``npu_fast_gelu``: that is a different
  function (``x / (1 + exp(-1.702 x))`` on Atlas A2/A3), not the tanh approximation.
* ``mul_add``: ``torch.addcmul(z, x, y)`` (``aclnnAddcmul``) in the promoted dtype; torch_npu has no
  custom op for it.
* ``rms_norm_quantize`` / ``layer_norm_modulate_quantize`` (int8): the norm above, then
  ``npu_dynamic_quant`` (the ``quantize_per_token_int8`` kernel). torch_npu's fused norm+quant ops
  do not fit: ``npu_rms_norm_quant`` takes a static scale, and ``npu_add_rms_norm_dynamic_quant``
  needs a second full-size input to add and writes the sum, more traffic than the two ops. Its
  dynamic quantization (``dst_type``) offers int8 and int4 only, so float8 runs the reference.

Signatures and limits follow the torch_npu API reference and the op-plugin sources (``docs/ascend.md``
lists them); none of this has run on Ascend hardware.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_npu
from torch import Tensor

from sdkiln.kernels.npu import quant
from sdkiln.kernels.npu.quant import KERNEL_NAME, check_half
from sdkiln.kernels.ops.elementwise import check_broadcast
from sdkiln.kernels.ops.norm import per_sample
from sdkiln.kernels.registry import register_kernel

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# npu_rotary_mul's documented cos/sin shapes (jit_compile=False, Atlas A2/A3) over x's three leading
# axes ("1": broadcast), per mode, with the axes of B and N in that layout. Only the readings that
# name one layout are used: "11S" and "B1S" are BNSD, "1S1" is BSND, "S11" is SBND.
ROPE_TABLES = {
    False: {"11S": (0, 1), "B1S": (0, 1), "1S1": (0, 2), "S11": (1, 2)},  # half: B, N < 1000
    True: {"11S": (0, 1), "1S1": (0, 2), "S11": (1, 2)},  # interleave: B * N < 1000
}
ROPE_MAX_HEAD_DIM = 896  # D < 896 and even, both modes


def _fits_rms_norm(x: Tensor, weight: Tensor | None) -> bool:
    """npu_rms_norm takes 2-8 dimensional float16/bfloat16/float32 input and a gamma of its last axis."""
    return (
        x.dtype in FLOAT_DTYPES
        and 2 <= x.dim() <= 8
        and (weight is None or (weight.dtype in FLOAT_DTYPES and tuple(weight.shape) == (x.shape[-1],)))
    )


@register_kernel(
    "rms_norm", "npu", name=KERNEL_NAME, supports=lambda x, weight, eps: _fits_rms_norm(x, weight)
)
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``npu_rms_norm(x, gamma, epsilon=eps)[0]`` (the second output, rstd, is for backward)."""
    if weight is None:
        gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    else:
        gamma = weight if weight.dtype == x.dtype else weight.float()
    y, _ = torch_npu.npu_rms_norm(x, gamma, epsilon=eps)
    return y.contiguous()


def _sample_rows(mod: Tensor, x: Tensor) -> Tensor | None:
    """A modulation as [R, D] rows, R = 1 (every sample) or B (one per sample), when it is the same
    for every token of a sample; None when it varies along the tokens."""
    mod = mod.reshape((1,) * (x.dim() - mod.dim()) + tuple(mod.shape))
    per_sample_rows = x.dim() >= 3
    token_axes = mod.shape[1:-1] if per_sample_rows else mod.shape[:-1]
    if any(n != 1 for n in token_axes):
        return None
    rows = mod.reshape(mod.shape[0] if per_sample_rows else 1, mod.shape[-1])
    return rows.expand(rows.shape[0], x.shape[-1])


@register_kernel(
    "layer_norm_modulate",
    "npu",
    name=KERNEL_NAME,
    supports=lambda x, scale, shift, eps: x.dtype in FLOAT_DTYPES,
)
def layer_norm_modulate(x: Tensor, scale: Tensor, shift: Tensor, eps: float) -> Tensor:
    """Per sample, ``F.layer_norm(x[b], weight=1 + scale[b], bias=shift[b])``; token-wise,
    ``torch.addcmul(shift, F.layer_norm(x), 1 + scale)``. ``1 + scale`` (in float32) and shift are
    rounded to x's dtype."""
    scale, shift = per_sample(scale, x), per_sample(shift, x)
    check_broadcast("layer_norm_modulate", x, scale, shift)
    d = x.shape[-1]
    weight_rows, bias_rows = _sample_rows(scale, x), _sample_rows(shift, x)
    if weight_rows is None or bias_rows is None:
        y = F.layer_norm(x, (d,), eps=eps)
        return torch.addcmul(shift.to(x.dtype), y, (1 + scale.float()).to(x.dtype)).contiguous()
    weight, bias = (1 + weight_rows.float()).to(x.dtype), bias_rows.to(x.dtype)
    if weight.shape[0] == bias.shape[0] == 1:
        return F.layer_norm(x, (d,), weight[0], bias[0], eps).contiguous()
    samples = [
        F.layer_norm(x[i], (d,), weight[min(i, weight.shape[0] - 1)], bias[min(i, bias.shape[0] - 1)], eps)
        for i in range(x.shape[0])
    ]
    return torch.stack(samples)


def _fits_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> bool:
    """x 4-D, D even and < 896, cos/sin one documented table shape, B and N within the mode's limits."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    if x.dim() != 4 or dtype not in FLOAT_DTYPES or cos.shape != sin.shape or not 1 <= cos.dim() <= 4:
        return False
    d = x.shape[-1]
    if d % 2 or d >= ROPE_MAX_HEAD_DIM or cos.shape[-1] != d:
        return False
    table = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    for pattern, (b_axis, n_axis) in ROPE_TABLES[interleaved].items():
        if all(
            (t == 1) if p == "1" else (t == n)
            for p, t, n in zip(pattern, table[:3], x.shape[:3], strict=True)
        ):
            b, n = x.shape[b_axis], x.shape[n_axis]
            return b * n < 1000 if interleaved else (b < 1000 and n < 1000)
    return False


@register_kernel("rope", "npu", name=KERNEL_NAME, supports=_fits_rope)
def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``npu_rotary_mul(x, cos4, sin4)`` (rotate-half) or ``rotary_mode="interleave"`` (pairs), in the
    promoted dtype of x, cos and sin, rounded to x's dtype."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    shape = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    r1, r2 = cos.to(dtype).reshape(shape), sin.to(dtype).reshape(shape)
    if interleaved:
        y = torch_npu.npu_rotary_mul(x.to(dtype), r1, r2, rotary_mode="interleave")
    else:
        y = torch_npu.npu_rotary_mul(x.to(dtype), r1, r2)
    return y.to(x.dtype).contiguous()


@register_kernel(
    "gelu_tanh", "npu", name=KERNEL_NAME, supports=lambda x: x.dtype in FLOAT_DTYPES and x.dim() <= 8
)
def gelu_tanh(x: Tensor) -> Tensor:
    """``npu_gelu(x, approximate="tanh")``."""
    return torch_npu.npu_gelu(x, approximate="tanh").contiguous()


@register_kernel(
    "mul_add",
    "npu",
    name=KERNEL_NAME,
    supports=lambda x, y, z: all(t.dtype in FLOAT_DTYPES for t in (x, y, z)),
)
def mul_add(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """``torch.addcmul(z, x, y)`` in the promoted dtype of the three."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), z.dtype)
    return torch.addcmul(z.to(dtype), x.to(dtype), y.to(dtype)).contiguous()


@register_kernel(
    "rms_norm_quantize",
    "npu",
    name=KERNEL_NAME,
    supports=lambda x, weight, eps, qdtype: qdtype == torch.int8 and _fits_rms_norm(x, weight),
)
def rms_norm_quantize(
    x: Tensor, weight: Tensor | None, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``npu_rms_norm`` then ``npu_dynamic_quant``: int8 values like x, float32 scales [..., 1]."""
    check_half("rms_norm_quantize", "activations", x.dtype)
    return quant.quantize_per_token_int8(rms_norm(x, weight, eps))


@register_kernel(
    "layer_norm_modulate_quantize",
    "npu",
    name=KERNEL_NAME,
    supports=lambda x, scale, shift, eps, qdtype: qdtype == torch.int8,
)
def layer_norm_modulate_quantize(
    x: Tensor, scale: Tensor, shift: Tensor, eps: float, qdtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``layer_norm_modulate`` above then ``npu_dynamic_quant``."""
    check_half("layer_norm_modulate_quantize", "activations", x.dtype)
    return quant.quantize_per_token_int8(layer_norm_modulate(x, scale, shift, eps))


@register_kernel(
    "lora_add",
    "npu",
    name=KERNEL_NAME,
    supports=lambda x, lora_a, lora_b, scale, base: (
        x.dtype in FLOAT_DTYPES and lora_a.dtype == lora_b.dtype == base.dtype == x.dtype
    ),
)
def lora_add(x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor, base: Tensor) -> Tensor:
    """The LoRA branch as two cube-unit matmuls in the model dtype (fp32 accumulation): the shrink
    ``x @ A^T`` scaled per rank in fp32, then ``torch.addmm(base, shrunk, B^T)``. MindIE SD runs
    LoRA the same way, as plain matmuls beside the quantized ones; torch_npu has no fused LoRA op."""
    k, n = x.shape[-1], base.shape[-1]
    shrunk = (torch.matmul(x.reshape(-1, k), lora_a.t()).float() * scale).to(lora_b.dtype)
    return torch.addmm(base.reshape(-1, n), shrunk, lora_b.t()).reshape(base.shape).contiguous()
