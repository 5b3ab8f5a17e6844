"""Ascend kernels: the ``sdkiln`` ops on torch_npu's fused ops, registered for the "npu" device.

``load_device_kernels("npu")`` imports this package (``NpuPlatform.kernel_modules``); nothing else
does, because importing it imports torch_npu (which fails, and breaks ``import torch``, without
Ascend's CANN). Ops without a kernel here run their pure-torch reference on the NPU, as on any
device without a kernel of its own.
"""

from sdkiln.kernels.npu import quant
from sdkiln.kernels.npu.quant import KERNEL_NAME

__all__ = ["KERNEL_NAME", "quant"]
