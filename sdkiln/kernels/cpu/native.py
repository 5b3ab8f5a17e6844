"""sdkiln's own exact int8 linears for x86 CPUs with AVX2 (``csrc/int8.c``), built on first use.

Why: at the embedded model's shapes a W8A8 linear's time is mostly the dozen torch ops around the
product (quantize the activations per token, dequantize the int32 sums): about 65 us of fixed cost
against 13 us for the whole fp32 Linear of 16 tokens. The C code does the quantization, the product
and the dequantization in one call with the references' fp32 operations in the references' order,
so its results are the references' bit for bit. Its own product is exact for every int8 value: on
AVX2, int8 widened to int16 and ``vpmaddwd``, about fp32 speed, where ``torch._int_mm`` is slow
(AVX2 without VNNI); with AVX-512 VNNI, ``vpdpbusd`` on activations offset by 128. It is
single-threaded; the CPU profile measures it against the multi-threaded products at the process's
thread count before choosing it.

The library is compiled once per source, compiler and flags with the system's C compiler (``$CC``,
else ``cc``, ``gcc`` or ``clang``) into ``$XDG_CACHE_HOME/sdkiln/native`` (about 1 s) and loaded with
ctypes: the AVX-512 VNNI build where the CPU reports ``avx512_vnni`` and ``avx512bw``, else the AVX2
build. Where it cannot be (no AVX2, no compiler, a failed build, ``SDKILN_CPU_NATIVE=0``),
``status()`` says why, the kernels that need it decline, and ``sdkiln inspect``/``run --verbose``
show the reason in the CPU's kernel table.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "int8.c"
FLAGS = ("-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
"""-ffp-contract=off: no fused multiply-adds, so every fp32 operation rounds as torch's does."""
VARIANTS = {
    "avx512_vnni": ("-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-mavx2",),
}
"""Build -> its instruction-set flags; ``variant()`` picks the first this CPU runs."""
VARIANT_NEEDS = {"avx512_vnni": {"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "avx2": {"avx2"}}
COMPILE_TIMEOUT_S = 120
log = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "sdkiln_w8a8_dynamic": (ctypes.c_int, [_P, _I, _I, _P, _I, _P, _P, _P, _P]),
    "sdkiln_w8a8_static": (ctypes.c_int, [_P, _I, _I, _P, _P, _P, _I, _P, _P, _P]),
    "sdkiln_int8_product": (ctypes.c_int, [_P, _I, _I, _P, _I, _P]),
    "sdkiln_quant_per_token": (None, [_P, _I, _I, _P, _P]),
    "sdkiln_quant_per_tensor": (None, [_P, _I, _I, _F, _F, _P]),
    "sdkiln_dequant_per_token": (None, [_P, _I, _I, _P, _P, _P, _P]),
    "sdkiln_dequant_per_tensor": (None, [_P, _I, _I, _P, _P, _P]),
}


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    detail: str
    """The library's path when available, else why not."""


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            return path
    return None


def _build_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sdkiln" / "native"


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def variant(features: frozenset[str]) -> str | None:
    """The build for a CPU with these ``cpu_profile.ISA_FLAGS`` features, or None."""
    return next((v for v, needs in VARIANT_NEEDS.items() if needs <= features), None)


def _build(cc: str, name: str) -> Path:
    """The compiled library of build ``name``, built now unless the cache has it; raises
    RuntimeError with the compiler's last line on failure."""
    flags = (*FLAGS, *VARIANTS[name])
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(flags).encode() + _compiler_version(cc).encode()).hexdigest()[:16]
    out = _build_dir() / f"int8_{name}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".int8_{name}.", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
        os.replace(tmp, out)  # atomic: a parallel process loads either nothing or the whole file
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cc).name} ran over {COMPILE_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_variant(name: str) -> tuple[ctypes.CDLL | None, NativeStatus]:
    """Build ``name`` (a ``VARIANTS`` key) for this machine and load it: (library, status), or
    (None, why not). Tests load each build this CPU runs."""
    from sdkiln.kernels.cpu_profile import read_cpu_info

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, NativeStatus(False, f"not built for {platform.machine()} (x86-64 only)")
    missing = VARIANT_NEEDS[name] - read_cpu_info().features
    if missing:
        return None, NativeStatus(False, f"this CPU has no {', '.join(sorted(missing))}")
    cc = _compiler()
    if cc is None:
        return None, NativeStatus(False, "no C compiler found (set CC, or install cc/gcc/clang)")
    try:
        path = _build(cc, name)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        log.warning("sdkiln: the native CPU int8 kernels (%s) are unavailable: %s", name, err)
        return None, NativeStatus(False, f"build failed: {err}")
    for symbol, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, NativeStatus(True, f"{name} build, {path}")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, NativeStatus]:
    """The build the kernels use: ``SDKILN_CPU_NATIVE`` = 0 (none), a ``VARIANTS`` name, or unset
    (the first this CPU runs)."""
    from sdkiln.kernels.cpu_profile import read_cpu_info

    choice = os.environ.get("SDKILN_CPU_NATIVE", "auto")
    if choice == "0":
        return None, NativeStatus(False, "off (SDKILN_CPU_NATIVE=0)")
    if choice not in (*VARIANTS, "auto"):
        why = f"SDKILN_CPU_NATIVE={choice!r} is not 0, auto or one of {', '.join(VARIANTS)}"
        log.warning("sdkiln: the native CPU int8 kernels are off: %s", why)
        return None, NativeStatus(False, why)
    name = variant(read_cpu_info().features) if choice == "auto" else choice
    if name is None:
        return None, NativeStatus(False, "this CPU has no AVX2")
    return load_variant(name)


def status() -> NativeStatus:
    """Whether the native kernels can run here (building them on the first call), and the library
    or the reason."""
    return _load()[1]


def available() -> bool:
    return _load()[1].available


def _lib() -> ctypes.CDLL:
    lib, st = _load()
    if lib is None:
        raise RuntimeError(f"the native CPU int8 kernels are unavailable: {st.detail}")
    return lib


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: Tensor) -> tuple[Tensor, int, int]:
    """x as contiguous fp32 (one copy when it is another dtype or not contiguous) and its rows M and
    row length K. (No view: at a 16-token layer each Python-level torch call is a tenth of the time.)"""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()  # .to(memory_format=) alone returns x when the dtype matches
    k = x.shape[-1]
    return x, (x.numel() // k if k else 0), k


def _checked(rc: int) -> None:
    if rc != 0:
        raise MemoryError("the native CPU int8 kernel could not allocate its scratch rows")


def w8a8_dynamic(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``w8a8_linear(*quantize_per_token_int8(x), weight, weight_scale, bias, float32)`` with the
    native product: fp32 [..., N]. The caller checks shapes and dtypes."""
    xr, m, k = _rows(x)
    n = weight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    _checked(
        _lib().sdkiln_w8a8_dynamic(
            xr.data_ptr(),
            m,
            k,
            weight.data_ptr(),
            n,
            weight_scale.data_ptr(),
            _ptr(bias),
            None,
            out.data_ptr(),
        )
    )
    return out


def w8a8_static(
    x: Tensor, scale: Tensor, offset: Tensor, weight: Tensor, quant_bias: Tensor, deq_scale: Tensor
) -> Tensor:
    """``w8a8_static_linear(quantize_per_tensor_int8(x, scale, offset), ...)`` with the native product
    (scale and offset: one fp32 value each): fp32 [..., N]."""
    xr, m, k = _rows(x)
    n = weight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    _checked(
        _lib().sdkiln_w8a8_static(
            xr.data_ptr(),
            m,
            k,
            scale.data_ptr(),
            offset.data_ptr(),
            weight.data_ptr(),
            n,
            quant_bias.data_ptr(),
            deq_scale.data_ptr(),
            out.data_ptr(),
        )
    )
    return out


def int8_product(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 a [M, K] and b [N, K], as int32 [M, N]."""
    a = a.contiguous()
    m, k = a.shape
    n = b.shape[0]
    acc = torch.empty(m, n, dtype=torch.int32)
    _checked(_lib().sdkiln_int8_product(a.data_ptr(), m, k, b.contiguous().data_ptr(), n, acc.data_ptr()))
    return acc


def quant_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_per_token_int8_reference`` on x's rows: (int8 [M, K], fp32 scales [M, 1])."""
    xr, m, k = _rows(x)
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    _lib().sdkiln_quant_per_token(xr.data_ptr(), m, k, q.data_ptr(), scale.data_ptr())
    return q, scale


def quant_per_tensor(x: Tensor, scale: float, offset: float) -> Tensor:
    """``quantize_per_tensor_int8_reference`` on x's rows: int8 [M, K]."""
    xr, m, k = _rows(x)
    q = torch.empty(m, k, dtype=torch.int8)
    _lib().sdkiln_quant_per_tensor(xr.data_ptr(), m, k, scale, offset, q.data_ptr())
    return q


def dequant_per_token(acc: Tensor, x_scale: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """``(float(acc) * x_scale) * weight_scale (+ bias)`` in fp32, as the reference orders it
    (contiguous fp32 scales and bias)."""
    acc = acc.contiguous()
    m, n = acc.shape
    out = torch.empty(m, n, dtype=torch.float32)
    _lib().sdkiln_dequant_per_token(
        acc.data_ptr(), m, n, x_scale.data_ptr(), weight_scale.data_ptr(), _ptr(bias), out.data_ptr()
    )
    return out


def dequant_per_tensor(acc: Tensor, quant_bias: Tensor, deq_scale: Tensor) -> Tensor:
    """``float(acc + quant_bias) * deq_scale`` in fp32."""
    acc = acc.contiguous()
    m, n = acc.shape
    out = torch.empty(m, n, dtype=torch.float32)
    _lib().sdkiln_dequant_per_tensor(
        acc.data_ptr(), m, n, quant_bias.data_ptr(), deq_scale.data_ptr(), out.data_ptr()
    )
    return out
