"""What this CPU does fast: its instruction sets, and measured times of the products kernels choose
between.

The same int8 product is 3.5-4.6x faster than an fp32 matmul on a CPU with AVX-512 VNNI and 35-57x
*slower* on an AMD EPYC with AVX2 only (docs/kernels.md); bf16 matmuls range from 2x faster than
fp32 (AVX-512 BF16) to 80x slower. Flags alone do not say which: a hypervisor can hide them and
torch's kernels are not built for every one. So the profile holds both:

* ``CpuInfo``: the model name and the instruction sets that matter, read from ``/proc/cpuinfo``
  (x86 flags; Arm ``Features``), and torch's own ATen capability;
* timings of the candidate products at one small shape (int8: ``torch._int_mm`` and the exact
  fp32-chunk product; fp32, bf16, fp16 matmuls), measured once per machine, torch version and
  thread count and cached in ``$XDG_CACHE_HOME/sdkiln/cpu_profile.json`` (about 0.1-1 s).

The decisions (``int8_product``, ``fast_dtypes``) read the timings when there are any and the flags
otherwise (``SDKILN_CPU_MEASURE=0``). ``cpu_profile()`` is what every kernel's ``supports`` asks;
tests replace it to pretend another processor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2",),
    "fma": ("fma",),
    "avx512f": ("avx512f",),
    "avx512_vnni": ("avx512_vnni",),
    "avx_vnni": ("avx_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "avx512_fp16": ("avx512_fp16",),
    "amx_int8": ("amx_int8",),
    "amx_bf16": ("amx_bf16",),
    "amx_fp16": ("amx_fp16",),
    "neon": ("asimd", "neon"),
    "sve": ("sve",),
    "i8mm": ("i8mm",),
    "arm_bf16": ("bf16",),
}
"""The instruction sets that decide int8 and 16-bit speed -> the ``/proc/cpuinfo`` flags naming them."""
INT8_FAST_ISA = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "i8mm"})
BF16_FAST_ISA = frozenset({"avx512_bf16", "amx_bf16", "arm_bf16"})
FP16_FAST_ISA = frozenset({"avx512_fp16", "amx_fp16"})
INT8_PRODUCTS = ("int_mm", "fp32_chunks")
"""The exact int8 x int8 -> int32 products on a CPU (``sdkiln.kernels.ops.int8``)."""
PROBE_SHAPE = (128, 512, 512)
"""M x K x N of the timed products: big enough for the BLAS kernels to reach their speed, small
enough that a 50x slow path costs tens of milliseconds."""
PROFILE_VERSION = 1


@dataclass(frozen=True)
class CpuInfo:
    name: str
    arch: str
    features: frozenset[str]
    aten_capability: str

    def describe(self) -> str:
        isa = " ".join(sorted(self.features)) or "none of " + " ".join(ISA_FLAGS)
        return f"{self.name} ({self.arch}; {isa}; torch ATen {self.aten_capability})"


@dataclass(frozen=True)
class CpuProfile:
    info: CpuInfo
    threads: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Median milliseconds at ``PROBE_SHAPE``: ``int8:int_mm``, ``int8:fp32_chunks``,
    ``matmul:float32``, ``matmul:bfloat16``, ``matmul:float16``; empty when not measured."""

    @functools.cached_property
    def int8_product(self) -> str:
        """The exact int8 product kernels use here: the faster measured one, else by flags. (Asked
        on every int8 linear's dispatch, so computed once.)"""
        measured = {p: self.timings_ms[f"int8:{p}"] for p in INT8_PRODUCTS if f"int8:{p}" in self.timings_ms}
        if len(measured) == len(INT8_PRODUCTS):
            return min(measured, key=measured.__getitem__)
        return "int_mm" if self.info.features & INT8_FAST_ISA else "fp32_chunks"

    def fast_dtype(self, dtype: torch.dtype) -> bool:
        """Whether matmuls in ``dtype`` are at least as fast as fp32 here (always, for fp32)."""
        if dtype == torch.float32:
            return True
        name = str(dtype).removeprefix("torch.")
        key = f"matmul:{name}"
        if key in self.timings_ms and "matmul:float32" in self.timings_ms:
            return self.timings_ms[key] <= self.timings_ms["matmul:float32"]
        fast = {torch.bfloat16: BF16_FAST_ISA, torch.float16: FP16_FAST_ISA}.get(dtype, frozenset())
        return bool(self.info.features & fast)

    def table(self) -> list[tuple[str, str, str]]:
        """(what, choice, why) rows for ``sdkiln inspect`` and ``run --verbose``."""
        t = self.timings_ms
        measured = bool(t)

        def why(keys: list[str]) -> str:
            if not measured:
                return "from the flags (not measured)"
            return ", ".join(f"{k.split(':', 1)[1]} {t[k]:.2f} ms" for k in keys if k in t)

        rows = [
            (
                "int8 x int8 product (w8a8_linear, w8a8_static_linear)",
                self.int8_product,
                why([f"int8:{p}" for p in INT8_PRODUCTS]),
            )
        ]
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            choice = f"{name} kept" if self.fast_dtype(dtype) else f"{name} weights computed in float32"
            rows.append((f"{name} compute", choice, why(["matmul:float32", f"matmul:{name}"])))
        return rows

    def to_dict(self) -> dict:
        info = asdict(self.info) | {"features": sorted(self.info.features)}
        return {"info": info, "threads": self.threads, "timings_ms": dict(self.timings_ms)}


def _cpuinfo_fields() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return name or platform.processor() or platform.machine(), flags


def read_cpu_info() -> CpuInfo:
    """This CPU's model name and the ``ISA_FLAGS`` it reports."""
    name, flags = _cpuinfo_fields()
    features = frozenset(isa for isa, names in ISA_FLAGS.items() if flags & set(names))
    return CpuInfo(name, platform.machine(), features, torch.backends.cpu.get_cpu_capability())


def median_ms(fn, reps: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def measure_products() -> dict[str, float]:
    """Median times of the candidate products at ``PROBE_SHAPE`` with this process's thread count."""
    from sdkiln.kernels.ops.int8 import int8_matmul_fp32_chunks

    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    timings = {
        "int8:int_mm": median_ms(lambda: torch._int_mm(a, b.T)),
        "int8:fp32_chunks": median_ms(lambda: int8_matmul_fp32_chunks(a, b)),
    }
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = a.to(dtype), b.to(dtype)
        timings[f"matmul:{str(dtype).removeprefix('torch.')}"] = median_ms(lambda x=x, w=w: x @ w.T)
    return timings


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sdkiln" / "cpu_profile.json"


def _cache_key(info: CpuInfo, threads: int) -> str:
    text = f"v{PROFILE_VERSION}|{info.describe()}|torch {torch.__version__}|threads {threads}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, entries: dict) -> None:
    """Atomically (a parallel test worker may read it meanwhile); an unwritable cache only means
    measuring again in the next process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_profile.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def cpu_profile() -> CpuProfile:
    """This machine's profile: measured once per (CPU, torch, thread count) and cached on disk;
    ``SDKILN_CPU_MEASURE=0`` skips the measurement and decides from the flags."""
    info, threads = read_cpu_info(), torch.get_num_threads()
    if os.environ.get("SDKILN_CPU_MEASURE", "1") == "0":
        return CpuProfile(info, threads)
    path, key = cache_file(), _cache_key(info, threads)
    entries = _read_cache(path)
    timings = entries.get(key, {}).get("timings_ms")
    if not isinstance(timings, dict):
        timings = measure_products()
        entries[key] = CpuProfile(info, threads, timings).to_dict()
        _write_cache(path, entries)
    return CpuProfile(info, threads, {str(k): float(v) for k, v in timings.items()})
