"""The CPU's kernels chosen by what the processor does fast: the profile's decisions for pretended
processors, the kernel each choice runs, exactness against the reference, and the per-machine cache."""

import json

import pytest
import torch

import sdkiln.kernels as K
from sdkiln.kernels import cpu_profile as cp
from sdkiln.kernels import registry
from sdkiln.kernels.ops import int8

K.load_device_kernels("cpu")
from sdkiln.kernels.cpu import int8 as cpu_int8  # noqa: E402  (registered by the line above)

AVX2_ONLY = frozenset({"avx2", "fma"})  # the AMD EPYC without VNNI of issue 30
VNNI = frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})
ARM_I8MM = frozenset({"neon", "i8mm"})


def pretend(features: frozenset, timings: dict | None = None) -> cp.CpuProfile:
    return cp.CpuProfile(cp.CpuInfo("pretended CPU", "x86_64", features, "AVX2"), 1, timings or {})


@pytest.mark.parametrize(
    "features, timings, product",
    [
        (AVX2_ONLY, None, "fp32_chunks"),
        (VNNI, None, "int_mm"),
        (ARM_I8MM, None, "int_mm"),
        # a measurement overrides the flags, both ways
        (VNNI, {"int8:int_mm": 9.0, "int8:fp32_chunks": 1.0}, "fp32_chunks"),
        (AVX2_ONLY, {"int8:int_mm": 1.0, "int8:fp32_chunks": 2.0}, "int_mm"),
        # half a measurement is no measurement
        (AVX2_ONLY, {"int8:int_mm": 1.0}, "fp32_chunks"),
    ],
)
def test_int8_product_from_flags_or_timings(features, timings, product):
    assert pretend(features, timings).int8_product == product


def test_fast_dtypes():
    assert pretend(AVX2_ONLY).fast_dtype(torch.float32)
    assert not pretend(AVX2_ONLY).fast_dtype(torch.bfloat16)
    assert pretend(VNNI | {"avx512_bf16"}).fast_dtype(torch.bfloat16)
    assert not pretend(VNNI | {"avx512_bf16"}).fast_dtype(torch.float16)
    slow = {"matmul:float32": 1.0, "matmul:bfloat16": 80.0, "matmul:float16": 0.5}
    assert not pretend(VNNI | {"avx512_bf16"}, slow).fast_dtype(torch.bfloat16)
    assert pretend(AVX2_ONLY, slow).fast_dtype(torch.float16)


def test_cpu_info_reads_flags(monkeypatch):
    monkeypatch.setattr(cp, "_cpuinfo_fields", lambda: ("Some CPU", {"avx2", "fma", "sse4_2", "amx_int8"}))
    info = cp.read_cpu_info()
    assert info.name == "Some CPU"
    assert info.features == {"avx2", "fma", "amx_int8"}
    assert "amx_int8" in info.describe() and "Some CPU" in info.describe()


def test_measured_products_on_this_machine():
    """The real measurement: every candidate product timed, and the table shows the times."""
    timings = cp.measure_products()
    assert set(timings) == {f"int8:{p}" for p in cp.INT8_PRODUCTS} | {
        f"matmul:{d}" for d in ("float32", "bfloat16", "float16")
    }
    assert all(t > 0 for t in timings.values())
    what, choice, why = cp.CpuProfile(cp.read_cpu_info(), 1, timings).table()[0]
    assert f"int_mm {timings['int8:int_mm']:.2f} ms" in why and choice in cp.INT8_PRODUCTS


def dynamic_args(m, k, n, bias, out_dtype):
    x = torch.randn(m, k)
    x[0] = 0.0  # an all-zero row (scale 1)
    x_q, x_scale = int8.quantize_per_token_int8_reference(x)
    w_q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    w_q[0] = -128
    w_scale = torch.rand(n, 1) / 100
    b = torch.randn(n) if bias else None
    return x_q, x_scale, w_q, w_scale, b, out_dtype


def static_args(m, k, n, out_dtype):
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    return x_q, w_q, torch.rand(n) / 1000, torch.randint(-(2**26), 2**26, (n,), dtype=torch.int32), out_dtype


@pytest.mark.parametrize("features, kernel", [(AVX2_ONLY, "fp32_chunks"), (VNNI, "int_mm")])
@pytest.mark.parametrize("k", [128, 2500], ids=["one_chunk", "three_chunks"])
def test_chosen_kernel_runs_and_is_exact(monkeypatch, features, kernel, k):
    monkeypatch.setattr(cp, "cpu_profile", lambda: pretend(features))
    ran = []
    for name in ("_int_mm_product", "_fp32_product"):
        real = getattr(cpu_int8, name)
        monkeypatch.setattr(cpu_int8, name, lambda a, b, real=real, name=name: ran.append(name) or real(a, b))
    expected_fn = {"int_mm": "_int_mm_product", "fp32_chunks": "_fp32_product"}[kernel]
    K.reset_kernel_counts()
    for out_dtype in (torch.float32, torch.bfloat16):
        for bias in (True, False):
            args = dynamic_args(37, k, 19, bias, out_dtype)
            assert K.implementation("w8a8_linear", "cpu", *args) == kernel
            ran.clear()
            out = K.w8a8_linear(*args)
            assert ran == [expected_fn]
            assert torch.equal(out, int8.w8a8_linear_reference(*args))
        args = static_args(23, k, 11, out_dtype)
        assert K.implementation("w8a8_static_linear", "cpu", *args) == kernel
        ran.clear()
        out = K.w8a8_static_linear(*args)
        assert ran == [expected_fn]
        assert torch.equal(out, int8.w8a8_static_linear_reference(*args))
    assert K.kernel_counts() == {("w8a8_linear", "cpu", kernel): 4, ("w8a8_static_linear", "cpu", kernel): 2}


def test_int8_kernels_are_registered_in_priority_order():
    for op in ("w8a8_linear", "w8a8_static_linear"):
        names = [k.name for k in registry.kernels(op, "cpu")]
        assert names == ["int_mm", "fp32_chunks"]


def test_profile_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SDKILN_CPU_MEASURE", raising=False)
    calls = []
    fake = {"int8:int_mm": 5.0, "int8:fp32_chunks": 1.0, "matmul:float32": 1.0, "matmul:bfloat16": 3.0}
    monkeypatch.setattr(cp, "measure_products", lambda: calls.append(1) or dict(fake))
    cp.cpu_profile.cache_clear()
    try:
        first = cp.cpu_profile()
        assert calls == [1] and first.timings_ms == fake and first.int8_product == "fp32_chunks"
        stored = json.loads((tmp_path / "sdkiln" / "cpu_profile.json").read_text())
        [entry] = stored.values()
        assert entry["timings_ms"] == fake and entry["threads"] == torch.get_num_threads()
        cp.cpu_profile.cache_clear()
        assert cp.cpu_profile().timings_ms == fake and calls == [1]  # read back, not measured again
        (tmp_path / "sdkiln" / "cpu_profile.json").write_text("not json")
        cp.cpu_profile.cache_clear()
        assert cp.cpu_profile().timings_ms == fake and calls == [1, 1]  # a damaged cache is remeasured
        monkeypatch.setenv("SDKILN_CPU_MEASURE", "0")
        cp.cpu_profile.cache_clear()
        assert cp.cpu_profile().timings_ms == {} and calls == [1, 1]
    finally:
        cp.cpu_profile.cache_clear()
