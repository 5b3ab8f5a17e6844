"""Ascend kernels: the ``sdkiln`` ops on torch_npu's fused ops, registered for the "npu" device.

``current_platform()`` imports this package and calls ``register_npu_kernels()`` when it detects an
NPU; nothing else imports it, because importing it imports torch_npu (which fails, and breaks
``import torch``, without Ascend's CANN). Ops without an entry here run their pure-torch reference
on the NPU, as on any device without a kernel of its own.
"""

from __future__ import annotations

from sdkiln.kernels.npu.quant import NPU_KERNELS
from sdkiln.kernels.ops import implementation, register_kernel, remove_kernel

KERNEL_NAME = "torch_npu"


def register_npu_kernels() -> list[str]:
    """Register every torch_npu kernel not registered yet; returns the ops now served by torch_npu."""
    for op, fn in NPU_KERNELS.items():
        if implementation(op, "npu") != KERNEL_NAME:
            register_kernel(op, "npu", name=KERNEL_NAME)(fn)
    return sorted(NPU_KERNELS)


def remove_npu_kernels() -> None:
    """Unregister them again (tests); the references run on the NPU afterwards."""
    for op in NPU_KERNELS:
        if implementation(op, "npu") == KERNEL_NAME:
            remove_kernel(op, "npu")
