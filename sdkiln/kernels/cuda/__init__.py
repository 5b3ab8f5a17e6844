"""NVIDIA kernels of the ``sdkiln`` ops, registered for the "cuda" device by
``load_device_kernels("cuda")`` (``CudaPlatform.kernel_modules``). Nothing here imports triton."""

from sdkiln.kernels.cuda import scaled_mm

__all__ = ["scaled_mm"]
