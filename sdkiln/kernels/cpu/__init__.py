"""CPU kernels of the ``sdkiln`` ops, registered for the "cpu" device by ``load_device_kernels("cpu")``
(``CpuPlatform.kernel_modules``). Every other op runs its pure-torch reference on the CPU."""

from sdkiln.kernels.cpu import attention, int8

__all__ = ["attention", "int8"]
