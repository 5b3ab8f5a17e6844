"""One object that answers device questions: which accelerator, its dispatch key, its collective
backend, which modules hold its fused kernels, how to synchronize it and how much memory is in use.

Every device-type fact lives on the platform classes (``PLATFORMS``); ``DISPATCH_KEYS`` is derived
from them. Detection is lazy (on the first ``current_platform()``) and in this order: a CUDA device;
an Ascend NPU (torch_npu importable and reporting a device); otherwise the CPU. torch_npu is imported
only then, never by ``import sdkiln``: without Ascend's CANN its import fails, and it patches torch.
Detection registers no kernel: the runtime asks for a device's kernels explicitly
(``sdkiln.kernels.load_device_kernels``).
"""

from __future__ import annotations

import abc
import functools
import importlib
import importlib.util
import resource
import sys
import warnings
from types import ModuleType
from typing import ClassVar

import torch

from sdkiln.errors import DeviceError


class Platform(abc.ABC):
    """Device questions for one kind of machine; ``current_platform()`` returns the detected one."""

    device_type: ClassVar[str]
    dispatch_key: ClassVar[str]
    """The torch dispatch key of this device type's tensors (torch_npu claims PrivateUse1)."""
    dist_backend: ClassVar[str]
    kernel_modules: ClassVar[tuple[str, ...]] = ()
    """Modules whose import registers this device type's fused kernels (``load_device_kernels``)."""

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def is_npu(self) -> bool:
        return self.device_type == "npu"

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index)

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work queued on the device (a no-op on CPU)."""

    @abc.abstractmethod
    def set_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device (before its collectives are set up: nccl
        and hccl bind a process to the current device); a no-op on CPU."""

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Bytes in use: ``allocated_bytes``, ``peak_allocated_bytes``, ``reserved_bytes``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r}, dist_backend={self.dist_backend!r})"


class CpuPlatform(Platform):
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    kernel_modules = ("sdkiln.kernels.cpu",)

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def set_device(self, device: torch.device) -> None:
        return None

    def memory_stats(self) -> dict[str, int]:
        """The process's resident set (all of it, not only tensors), from /proc/self/status.

        Without /proc (macOS) only the peak is known, from ``getrusage``; it is reported for all
        three keys.
        """
        try:
            with open("/proc/self/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak *= 1 if sys.platform == "darwin" else 1024
            return {"allocated_bytes": peak, "peak_allocated_bytes": peak, "reserved_bytes": peak}
        rss = int(fields["VmRSS"].split()[0]) * 1024
        return {
            "allocated_bytes": rss,
            "peak_allocated_bytes": int(fields["VmHWM"].split()[0]) * 1024,
            "reserved_bytes": rss,
        }


class CudaPlatform(Platform):
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"
    kernel_modules = ("sdkiln.kernels.cuda", "sdkiln.kernels.triton")

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def memory_stats(self) -> dict[str, int]:
        """The caching allocator's counts for the current device."""
        return {
            "allocated_bytes": torch.cuda.memory_allocated(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
        }


class NpuPlatform(Platform):
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    dist_backend = "hccl"
    kernel_modules = ("sdkiln.kernels.npu",)

    def __init__(self, torch_npu: ModuleType):
        self._npu = torch_npu.npu

    def synchronize(self) -> None:
        self._npu.synchronize()

    def set_device(self, device: torch.device) -> None:
        self._npu.set_device(device)

    def memory_stats(self) -> dict[str, int]:
        """torch_npu's caching allocator counts for the current device."""
        return {
            "allocated_bytes": self._npu.memory_allocated(),
            "peak_allocated_bytes": self._npu.max_memory_allocated(),
            "reserved_bytes": self._npu.memory_reserved(),
        }


PLATFORMS: tuple[type[Platform], ...] = (CpuPlatform, CudaPlatform, NpuPlatform)
DISPATCH_KEYS = {p.device_type: p.dispatch_key for p in PLATFORMS}


def platform_class(device_type: str) -> type[Platform]:
    """The platform class of ``device_type`` ("cpu", "cuda", "npu")."""
    for p in PLATFORMS:
        if p.device_type == device_type:
            return p
    raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(DISPATCH_KEYS)}")


def _import_torch_npu() -> ModuleType | None:
    """torch_npu if it is installed and imports; a broken install warns and counts as absent."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError) as err:
        warnings.warn(
            f"torch_npu is installed but does not import ({err}); Ascend NPUs are not used. Install "
            "CANN and source its set_env.sh, or uninstall torch_npu.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


@functools.cache
def current_platform() -> Platform:
    """The platform of this process, detected on the first call (``cache_clear()`` re-detects)."""
    if torch.cuda.is_available():
        return CudaPlatform()
    torch_npu = _import_torch_npu()
    if torch_npu is not None and torch_npu.npu.is_available():
        return NpuPlatform(torch_npu)
    return CpuPlatform()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: the detected accelerator (device 0), else the CPU. Otherwise the named device,
    which must be the CPU or of this machine's accelerator type."""
    if device == "auto":
        return current_platform().device()
    device_type = str(device).split(":", 1)[0]
    if device_type not in DISPATCH_KEYS:
        raise DeviceError(f"device {str(device)!r}: not a device name (auto, cpu, cuda, cuda:1, npu, ...)")
    platform = current_platform()
    if device_type not in ("cpu", platform.device_type):
        raise DeviceError(
            f"device {str(device)!r} requested, but this machine has no {device_type} device "
            f"(detected platform: {platform.device_type})"
        )
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(
            f"device {str(device)!r}: not a device name (auto, cpu, cuda, cuda:1, npu, ...)"
        ) from None
    return parsed
