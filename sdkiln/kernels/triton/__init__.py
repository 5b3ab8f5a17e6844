"""Triton kernels of the ``sdkiln`` ops, registered as their "cuda" kernels under the name
``"triton"`` by ``load_device_kernels("cuda")`` (``CudaPlatform.kernel_modules``).

Each kernel is a ``torch.library.triton_op`` (namespace ``sdkiln_triton``) launched through
``wrap_triton``, so Inductor can trace into it where a graph calls it directly, and is registered
with a ``supports()`` predicate over the op's arguments; what a kernel does not support runs the
next kernel or the pure-torch reference. A compiled graph today calls the ``sdkiln`` op, which
Inductor treats as an extern kernel: its CUDA dispatcher picks the kernel and calls the triton_op
(one Python dispatch per call, which CUDA graphs remove). Lowering the ops to the triton_ops inside
the graph is GPU-performance work (docs/kernels.md). Every kernel follows the reference's numerics contract (``sdkiln.kernels.ops``) and is
tested against it (``tests/kernels/test_triton_kernels.py``), on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``) at small shapes and on a GPU where there is one.

Modules: ``rows`` (norms, adaLN, per-token quantization and their fused forms), ``elementwise``
(gelu_tanh, mul_add, rope, per-tensor quantization), ``gemm`` (the quantized linears),
``attention`` (flash attention with log-sum-exp, block-sparse attention), ``quantized_attention``
(INT8/FP8 QK^T, FP8/INT8/float PV), ``lora`` (the LoRA branch), ``configs`` (launch and
autotune configurations per GPU generation).
"""

from sdkiln.kernels.triton import attention, elementwise, gemm, lora, quantized_attention, rows
from sdkiln.kernels.triton.configs import KERNEL_NAME

REFERENCE_ONLY: dict[str, str] = {
    "fp8_block_attention": (
        "MindIE SD's FP8 attention arithmetic, for packages made for Ascend (attn-fp8-ascend); on CUDA it runs "
        "its reference (the dequantized blocks through SDPA): a package for GPUs uses attn-int8 or attn-fp8"
    ),
}
"""Ops without a Triton kernel, each with why: they run their reference on CUDA
(``tests/kernels/test_triton_kernels.py`` checks that no op is left out silently)."""

__all__ = [
    "KERNEL_NAME",
    "REFERENCE_ONLY",
    "attention",
    "elementwise",
    "gemm",
    "lora",
    "quantized_attention",
    "rows",
]
