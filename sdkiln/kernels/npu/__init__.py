"""Ascend kernels: the ``sdkiln`` ops on torch_npu's fused ops, registered for the "npu" device.

``load_device_kernels("npu")`` imports this package (``NpuPlatform.kernel_modules``); nothing else
does, because importing it imports torch_npu (which fails, and breaks ``import torch``, without
Ascend's CANN). ``quant`` maps the quantized ops, ``float_ops`` the norms, rotary embedding, GELU,
the gated residual and the norm + quantize pairs, ``attention`` dense and block-sparse attention.
Arguments a kernel's ``supports()`` declines run the op's pure-torch reference on the NPU.

Every op has an NPU kernel except those in ``REFERENCE_ONLY``, which run their reference there
(``tests/kernels/test_npu_mapping.py`` checks that no op is left out silently).
"""

from sdkiln.kernels.npu import attention, float_ops, quant
from sdkiln.kernels.npu.quant import KERNEL_NAME

REFERENCE_ONLY = {
    "quantized_attention": (
        "no torch_npu call computes this op's contract (Q per token, K per 64 keys after smoothing, P quantized): "
        "MindIE SD's FA quantization quantizes Q per 128 tokens and K, V per 256 without K smoothing; a package "
        "made for Ascend calibrates that arithmetic instead (fp8_block_attention, attn-fp8-ascend; docs/ascend.md)"
    ),
    "fp8_quantize_per_token": (
        "npu_dynamic_quant quantizes to int8 or int4 on Atlas A2/A3; torch_npu documents float8 outputs "
        "for Ascend 950 only"
    ),
    "fp8_linear": (
        "npu_quant_matmul takes int8 (or packed int4) on Atlas A2/A3; torch_npu documents float8 "
        "matmuls for Ascend 950 only"
    ),
}
"""Ops deliberately left on their reference on Ascend, with the reason."""

__all__ = ["KERNEL_NAME", "REFERENCE_ONLY", "attention", "float_ops", "quant"]
