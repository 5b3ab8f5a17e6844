"""Platform detection (cpu, cuda, a faked Ascend NPU) and the promise that importing sdkiln imports
neither triton nor torch_npu."""

import importlib.machinery
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from sdkiln.errors import DeviceError
from sdkiln.kernels import platform
from sdkiln.kernels.platform import CpuPlatform, current_platform, resolve_device

SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


@pytest.fixture
def fresh_platform():
    """Detect again in this test, and leave no detection behind for the next one."""
    current_platform.cache_clear()
    yield
    current_platform.cache_clear()


@pytest.fixture
def no_accelerator(monkeypatch, fresh_platform):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(platform, "_import_torch_npu", lambda: None)


def fake_torch_npu(has_device: bool) -> types.ModuleType:
    """A stand-in for torch_npu; the __spec__ keeps importlib.util.find_spec working on it."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.npu = types.SimpleNamespace(is_available=lambda: has_device)
    return module


def run_python(code: str, **env) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**SUBPROCESS_ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_cpu_platform(no_accelerator):
    p = current_platform()
    assert isinstance(p, CpuPlatform) and p is current_platform()
    assert (p.device_type, p.dispatch_key, p.dist_backend) == ("cpu", "CPU", "gloo")
    assert p.is_cpu and not p.is_cuda and not p.is_npu
    assert p.device() == p.device(1) == torch.device("cpu")
    p.synchronize()
    stats = p.memory_stats()
    assert set(stats) == {"allocated_bytes", "peak_allocated_bytes", "reserved_bytes"}
    assert 0 < stats["allocated_bytes"] <= stats["peak_allocated_bytes"]


def test_this_machine(fresh_platform):
    p = current_platform()
    if torch.cuda.is_available():
        assert (p.device_type, p.dispatch_key, p.dist_backend) == ("cuda", "CUDA", "nccl")
    else:
        assert p.device_type in ("npu", "cpu")
    assert resolve_device() == p.device()


def test_resolve_device(no_accelerator):
    assert resolve_device("auto") == resolve_device("cpu") == resolve_device(torch.device("cpu"))
    assert resolve_device() == torch.device("cpu")
    with pytest.raises(DeviceError, match="no cuda device"):
        resolve_device("cuda:0")
    with pytest.raises(DeviceError, match="no npu device"):
        resolve_device("npu")
    with pytest.raises(DeviceError, match="not a device name"):
        resolve_device("bogus")


def test_torch_npu_without_a_device_is_not_an_npu(monkeypatch, fresh_platform):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(has_device=False))
    assert current_platform().is_cpu


def test_a_broken_torch_npu_warns_and_is_not_used(monkeypatch, tmp_path, fresh_platform):
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        'raise OSError("libhccl.so: cannot open shared object file")\n'
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.warns(RuntimeWarning, match="torch_npu is installed but does not import.*libhccl"):
        assert current_platform().is_cpu
    assert "torch_npu" not in sys.modules


def test_npu_platform_with_a_fake_torch_npu():
    """In a subprocess: naming PrivateUse1 "npu" (as torch_npu does) cannot be undone."""
    run_python("""
        import importlib.machinery, sys, types
        import torch

        torch.cuda.is_available = lambda: False
        torch.utils.rename_privateuse1_backend("npu")
        calls = []
        fake = types.ModuleType("torch_npu")
        fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        fake.npu = types.SimpleNamespace(
            is_available=lambda: True,
            synchronize=lambda: calls.append("synchronize"),
            memory_allocated=lambda: 1,
            max_memory_allocated=lambda: 3,
            memory_reserved=lambda: 2,
        )
        sys.modules["torch_npu"] = fake

        from sdkiln.kernels import current_platform, resolve_device

        p = current_platform()
        assert (p.device_type, p.dispatch_key, p.dist_backend) == ("npu", "PrivateUse1", "hccl"), p
        assert "sdkiln.kernels.npu" not in sys.modules, "detecting the device loaded its kernels"
        assert p.is_npu and not p.is_cpu and not p.is_cuda
        assert p.device(1) == torch.device("npu", 1)
        assert resolve_device() == torch.device("npu", 0) == resolve_device("npu:0")
        assert resolve_device("cpu") == torch.device("cpu")
        p.synchronize()
        assert calls == ["synchronize"]
        assert p.memory_stats() == {"allocated_bytes": 1, "peak_allocated_bytes": 3, "reserved_bytes": 2}
        from sdkiln.errors import DeviceError

        try:
            resolve_device("cuda")
        except DeviceError:
            pass
        else:
            raise AssertionError("resolve_device('cuda') on an NPU machine did not raise")
    """)


def test_import_sdkiln_imports_neither_triton_nor_torch_npu(tmp_path):
    """Both are installed here as fakes that log their import; running a CPU op must not import them."""
    log = tmp_path / "imports.log"
    for name in ("triton", "torch_npu"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            "import os, traceback\n"
            "with open(os.environ['FAKE_IMPORT_LOG'], 'a') as f:\n"
            "    f.write(__name__ + ' imported from:\\n' + ''.join(traceback.format_stack()))\n"
        )
    run_python(
        """
        import importlib.util, sys
        assert importlib.util.find_spec("triton") and importlib.util.find_spec("torch_npu")
        import torch
        import sdkiln
        import sdkiln.kernels
        sdkiln.kernels.rms_norm(torch.ones(2, 4))
        assert "triton" not in sys.modules and "torch_npu" not in sys.modules
        """,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        FAKE_IMPORT_LOG=str(log),
    )
    assert not log.exists(), log.read_text()
