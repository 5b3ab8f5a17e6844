"""What this CPU does fast: its instruction sets, and measured times of the products kernels choose
between.

The same int8 product is 3.5-4.6x faster than an fp32 matmul on a CPU with AVX-512 VNNI and 35-57x
*slower* on an AMD EPYC with AVX2 only (docs/kernels.md); bf16 matmuls range from 2x faster than
fp32 (AVX-512 BF16) to 80x slower. Flags alone do not say which: a hypervisor can hide them and
torch's kernels are not built for every one. So the profile holds both:

* ``CpuInfo``: the model name and the instruction sets that matter, read from ``/proc/cpuinfo``
  (x86 flags; Arm ``Features``), and torch's own ATen capability;
* timings of the candidate products at one small shape (int8: ``torch._int_mm``, the exact
  fp32-chunk product and, where it builds, sdkiln's native AVX2 product; fp32, bf16, fp16
  matmuls), measured once per machine, torch version, thread count and native availability and
  cached in ``$XDG_CACHE_HOME/sdkiln/cpu_profile.json`` (about 0.1-1 s).

The decisions (``int8_product``, ``fast_dtypes``) read the timings when there are any and the flags
otherwise (``SDKILN_CPU_MEASURE=0``). ``cpu_profile()`` is what every kernel's ``supports`` asks;
tests replace it to pretend another processor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
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
    "avx512bw": ("avx512bw",),
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
INT8_PRODUCTS = ("int_mm", "fp32_chunks", "native")
"""The exact int8 x int8 -> int32 products on a CPU: ``torch._int_mm``, the fp32-chunk product
(``sdkiln.kernels.ops.int8``) and sdkiln's AVX2 code (``sdkiln.kernels.cpu.native``), the last
only where it could be built."""
PROBE_SHAPE = (128, 512, 512)
"""M x K x N of the timed products: big enough for the BLAS kernels to reach their speed, small
enough that a 50x slow path costs tens of milliseconds."""
SMALL_SHAPE = (16, 128, 128)
"""M x K x N where a call's fixed cost decides (the embedded model's 16 text tokens); int8
products are timed here too, and a product of less work than the geometric mean of the two shapes
takes this shape's fastest."""
PROFILE_VERSION = 5
EXACTNESS_SHAPE = (64, 512, 64)
"""M x K x N of the full-range product each candidate must reproduce exactly to be chosen."""


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
    ``int8:native``, ``matmul:float32``, ``matmul:bfloat16``, ``matmul:float16``; empty when not
    measured."""
    inexact: tuple[str, ...] = ()
    """The int8 products that got a full-range product wrong here (``torch._int_mm`` without VNNI
    saturates int16 sums): never chosen."""

    def _fastest(self, prefix: str) -> str:
        from sdkiln.kernels.cpu import native

        usable = [p for p in INT8_PRODUCTS if (p != "native" or native.available()) and p not in self.inexact]
        t = self.timings_ms
        measured = {p: t[f"{prefix}:{p}"] for p in usable if f"{prefix}:{p}" in t}
        if f"{prefix}:int_mm" in t and f"{prefix}:fp32_chunks" in t and measured:
            return min(measured, key=measured.__getitem__)
        if self.info.features & INT8_FAST_ISA:
            return "int_mm"
        return "native" if "native" in usable else "fp32_chunks"

    @functools.cached_property
    def int8_product(self) -> str:
        """The exact int8 product for large products here: the fastest measured at ``PROBE_SHAPE``
        of those verified exact (the native product only where it is available now), else by
        flags. (Asked on every int8 linear's dispatch, so computed once.)"""
        return self._fastest("int8")

    @functools.cached_property
    def int8_product_small(self) -> str:
        """The same at ``SMALL_SHAPE``, where the per-call cost decides."""
        return self._fastest("int8_small")

    @functools.cached_property
    def fused_product_small(self) -> str:
        """The product of the fastest fused W8A8 linear (``sdkiln.kernels.cpu.int8``: quantize,
        product, dequantize in one kernel) at ``SMALL_SHAPE``; where the fused kernels' own costs
        around the product decide."""
        return self._fastest("fused_small")

    small_work = math.sqrt(math.prod(SMALL_SHAPE) * math.prod(PROBE_SHAPE))
    """M * K * N below which the ``SMALL_SHAPE`` decisions hold."""

    def int8_product_for(self, m: int, k: int, n: int) -> str:
        """The product for an [m, k] x [k, n] call: the small shape's fastest below the geometric
        mean of the two measured shapes' work, the probe's at or above it."""
        return self.int8_product_small if m * k * n < self.small_work else self.int8_product

    def fused_product_for(self, m: int, k: int, n: int) -> str:
        """The same for the fused W8A8 linears."""
        return self.fused_product_small if m * k * n < self.small_work else self.int8_product

    def choosing(self, product: str) -> CpuProfile:
        """This profile with timings that make every int8 decision ``product`` (benchmarks and
        tests run each kernel this way)."""
        favoured = {
            f"{prefix}:{p}": (0.0 if p == product else 1.0)
            for prefix in ("int8", "int8_small", "fused_small")
            for p in INT8_PRODUCTS
        }
        return CpuProfile(self.info, self.threads, {**self.timings_ms, **favoured}, self.inexact)

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
            return ", ".join(
                f"{k.split(':', 1)[1]} {t[k]:.3g} ms"
                + (" (inexact here)" if k.split(":", 1)[1] in self.inexact else "")
                for k in keys
                if k in t
            )

        from sdkiln.kernels.cpu import native

        built = native.status()
        small = "x".join(map(str, SMALL_SHAPE))
        rows = [
            (
                "int8 x int8 product (w8a8_linear, w8a8_static_linear)",
                self.int8_product,
                why([f"int8:{p}" for p in INT8_PRODUCTS]),
            ),
            (
                f"the same, products of {small} and similar",
                self.int8_product_small,
                why([f"int8_small:{p}" for p in INT8_PRODUCTS]),
            ),
            (
                f"fused int8 linears of {small} and similar",
                self.fused_product_small,
                why([f"fused_small:{p}" for p in INT8_PRODUCTS]),
            ),
            (
                "native kernels (fused int8 linears)",
                "built" if built.available else "unavailable",
                built.detail,
            ),
        ]
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            choice = f"{name} kept" if self.fast_dtype(dtype) else f"{name} weights computed in float32"
            rows.append((f"{name} compute", choice, why(["matmul:float32", f"matmul:{name}"])))
        return rows

    def to_dict(self) -> dict:
        info = asdict(self.info) | {"features": sorted(self.info.features)}
        return {
            "info": info,
            "threads": self.threads,
            "timings_ms": dict(self.timings_ms),
            "inexact": list(self.inexact),
        }


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


def _int8_products() -> dict:
    from sdkiln.kernels.cpu import native
    from sdkiln.kernels.ops.int8 import int8_matmul_fp32_chunks

    products = {
        "int_mm": lambda a, b: torch._int_mm(a, b.T),
        "fp32_chunks": lambda a, b: int8_matmul_fp32_chunks(a, b),
    }
    if native.available():
        products["native"] = native.int8_product
    return products


def inexact_products() -> tuple[str, ...]:
    """The candidate int8 products that do not reproduce a full-range product (-128..127 on both
    sides, which saturates any int16 pair sum) exactly, against the float64 one."""
    from sdkiln.kernels.ops.int8 import int8_matmul_float64

    m, k, n = EXACTNESS_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    a[0], b[0] = 127, -128  # the largest pair sums, whatever the random draw
    exact = int8_matmul_float64(a, b)
    return tuple(p for p, fn in _int8_products().items() if not torch.equal(fn(a, b).to(torch.int32), exact))


def _measure_fused(gen: torch.Generator) -> dict[str, float]:
    """``fused_small:<product>``: one fused dynamic W8A8 linear at ``SMALL_SHAPE`` per product (only
    where the native kernels, which the fused linears need, are available). Timing them loads the
    CPU's kernels (``load_device_kernels("cpu")``), the one way a device's kernels register."""
    from sdkiln.kernels.cpu import native
    from sdkiln.kernels.registry import load_device_kernels

    if not native.available():
        return {}
    load_device_kernels("cpu")
    from sdkiln.kernels.cpu import int8 as cpu_int8

    m, k, n = SMALL_SHAPE
    x = torch.randn(m, k, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale, bias = torch.rand(n, generator=gen) / 100, torch.randn(n, generator=gen)
    kernels = {p: cpu_int8.fused_dynamic(p) for p in _int8_products()}
    return {
        f"fused_small:{p}": _per_call_ms(lambda fn=fn: fn(x, w, scale, bias), True)
        for p, fn in kernels.items()
    }


def measure_products() -> dict[str, float]:
    """Median times of the candidate products at ``PROBE_SHAPE`` (and the int8 ones at
    ``SMALL_SHAPE``) with this process's thread count."""
    gen = torch.Generator().manual_seed(0)
    timings = {}
    operands = {}
    for prefix, (m, k, n) in (("int8_small", SMALL_SHAPE), ("int8", PROBE_SHAPE)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        operands[prefix] = a, b
        for p, fn in _int8_products().items():
            timings[f"{prefix}:{p}"] = _per_call_ms(lambda fn=fn, a=a, b=b: fn(a, b), prefix == "int8_small")
    timings.update(_measure_fused(gen))
    a, b = operands["int8"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = a.to(dtype), b.to(dtype)
        timings[f"matmul:{str(dtype).removeprefix('torch.')}"] = median_ms(lambda x=x, w=w: x @ w.T)
    return timings


SMALL_CALLS = 20
"""Calls per timing of a ``SMALL_SHAPE`` call (about 10 us each), so the timer's own cost and a
single interruption do not decide."""


def _per_call_ms(fn, small: bool) -> float:
    if not small:
        return median_ms(fn)
    return median_ms(lambda: [fn() for _ in range(SMALL_CALLS)], 9) / SMALL_CALLS


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sdkiln" / "cpu_profile.json"


def _cache_key(info: CpuInfo, threads: int) -> str:
    from sdkiln.kernels.cpu import native

    text = (
        f"v{PROFILE_VERSION}|{info.describe()}|torch {torch.__version__}|threads {threads}"
        f"|native {native.status().detail if native.available() else 'none'}"
    )
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
    """This machine's profile: measured once per (CPU, torch, thread count, native kernels) and
    cached on disk;
    ``SDKILN_CPU_MEASURE=0`` skips the measurement and decides from the flags."""
    info, threads = read_cpu_info(), torch.get_num_threads()
    if os.environ.get("SDKILN_CPU_MEASURE", "1") == "0":
        return CpuProfile(info, threads)
    path, key = cache_file(), _cache_key(info, threads)
    entries = _read_cache(path)
    entry = entries.get(key, {})
    timings, inexact = entry.get("timings_ms"), entry.get("inexact")
    if not isinstance(timings, dict) or not isinstance(inexact, list):
        timings, inexact = measure_products(), list(inexact_products())
        entries[key] = CpuProfile(info, threads, timings, tuple(inexact)).to_dict()
        _write_cache(path, entries)
    return CpuProfile(info, threads, {str(k): float(v) for k, v in timings.items()}, tuple(map(str, inexact)))
