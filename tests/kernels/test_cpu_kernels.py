"""The CPU's kernels chosen by what the processor does fast: the profile's decisions for pretended
processors, the kernel each choice runs, exactness against the reference, and the per-machine cache.
The native kernels (``sdkiln.kernels.cpu.native``) are checked bit for bit in every build this CPU
runs, against the references."""

import json
import math

import pytest
import torch

import sdkiln.kernels as K
from sdkiln.kernels import cpu_profile as cp
from sdkiln.kernels import registry
from sdkiln.kernels.ops import int8

K.load_device_kernels("cpu")
from sdkiln.kernels.cpu import int8 as cpu_int8  # noqa: E402  (registered by the line above)
from sdkiln.kernels.cpu import native  # noqa: E402

AVX2_ONLY = frozenset({"avx2", "fma"})  # the AMD EPYC without VNNI of issue 30
VNNI = frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})
ARM_I8MM = frozenset({"neon", "i8mm"})


def pretend(features: frozenset, timings: dict | None = None) -> cp.CpuProfile:
    return cp.CpuProfile(cp.CpuInfo("pretended CPU", "x86_64", features, "AVX2"), 1, timings or {})


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)


@pytest.fixture
def with_native(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: True)


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
        # a native timing left in a profile does not count while the native kernels are unavailable
        (AVX2_ONLY, {"int8:int_mm": 9.0, "int8:fp32_chunks": 2.0, "int8:native": 1.0}, "fp32_chunks"),
    ],
)
def test_int8_product_from_flags_or_timings(no_native, features, timings, product):
    assert pretend(features, timings).int8_product == product


@pytest.mark.parametrize(
    "features, timings, product",
    [
        (AVX2_ONLY, None, "native"),
        (VNNI, None, "int_mm"),
        (AVX2_ONLY, {"int8:int_mm": 9.0, "int8:fp32_chunks": 2.0, "int8:native": 1.0}, "native"),
        (VNNI, {"int8:int_mm": 1.0, "int8:fp32_chunks": 2.0, "int8:native": 1.5}, "int_mm"),
    ],
)
def test_int8_product_with_native_kernels(with_native, features, timings, product):
    assert pretend(features, timings).int8_product == product


def test_inexact_product_is_never_chosen(with_native):
    timings = {"int8:int_mm": 0.1, "int8:fp32_chunks": 2.0, "int8:native": 1.0}
    prof = cp.CpuProfile(cp.CpuInfo("pretended CPU", "x86_64", AVX2_ONLY, "AVX2"), 1, timings, ("int_mm",))
    assert prof.int8_product == "native"
    assert "int_mm 0.1 ms (inexact here)" in prof.table()[0][2]


def test_products_are_chosen_by_the_size_of_the_call(with_native):
    timings = {
        "int8:int_mm": 1.0, "int8:fp32_chunks": 3.0, "int8:native": 2.0,
        "int8_small:int_mm": 0.02, "int8_small:fp32_chunks": 0.03, "int8_small:native": 0.01,
        "fused_small:int_mm": 0.03, "fused_small:fp32_chunks": 0.04, "fused_small:native": 0.01,
    }  # fmt: skip
    prof = pretend(VNNI, timings)
    edge = math.isqrt(int(prof.small_work))
    assert prof.int8_product_for(16, 128, 128) == prof.fused_product_for(16, 128, 128) == "native"
    assert prof.int8_product_for(128, 512, 512) == prof.fused_product_for(128, 512, 512) == "int_mm"
    assert prof.int8_product_for(1, edge + 1, edge + 1) == "int_mm"
    assert prof.int8_product_for(1, edge - 1, edge - 1) == "native"
    for product in cp.INT8_PRODUCTS:
        chosen = prof.choosing(product)
        assert chosen.int8_product == chosen.int8_product_small == chosen.fused_product_small == product


def test_saturating_product_is_found_inexact(monkeypatch):
    """torch._int_mm on a CPU without VNNI sums u8 x s8 pairs in saturating int16; a product that does
    the same is caught against the float64 one."""

    def saturating(a, b):
        pairs = (a.long().view(a.shape[0], 1, -1, 2) * b.long().view(1, b.shape[0], -1, 2)).sum(-1)
        return pairs.clamp(-(2**15), 2**15 - 1).sum(-1).to(torch.int32)

    monkeypatch.setattr(
        cp, "_int8_products", lambda: {"int_mm": saturating, "fp32_chunks": int8.int8_matmul_fp32_chunks}
    )
    assert cp.inexact_products() == ("int_mm",)


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
    """The real measurement: every candidate product timed (the native one and the fused linears
    where the native kernels build here), and the table shows the times; every product this
    machine would choose is exact here."""
    timings = cp.measure_products()
    products = cp.INT8_PRODUCTS if native.available() else ("int_mm", "fp32_chunks")
    expected = {f"{prefix}:{p}" for prefix in ("int8", "int8_small") for p in products}
    if native.available():
        expected |= {f"fused_small:{p}" for p in products}
    assert set(timings) == expected | {f"matmul:{d}" for d in ("float32", "bfloat16", "float16")}
    assert all(t > 0 for t in timings.values())
    inexact = cp.inexact_products()
    prof = cp.CpuProfile(cp.read_cpu_info(), 1, timings, inexact)
    what, choice, why = prof.table()[0]
    assert f"int_mm {timings['int8:int_mm']:.3g} ms" in why and choice in cp.INT8_PRODUCTS
    assert {prof.int8_product, prof.int8_product_small, prof.fused_product_small}.isdisjoint(inexact)


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


def needs_native():
    if not native.available():
        pytest.skip(f"the native CPU kernels are unavailable here: {native.status().detail}")


@pytest.mark.parametrize("kernel", ["fp32_chunks", "int_mm", "native"])
@pytest.mark.parametrize("k", [128, 2500], ids=["one_chunk", "three_chunks"])
def test_chosen_kernel_runs_and_is_exact(monkeypatch, kernel, k):
    if kernel == "native":
        needs_native()
    monkeypatch.setattr(cp, "cpu_profile", lambda: pretend(VNNI).choosing(kernel))
    ran = []
    for name in ("_int_mm_product", "_fp32_product"):
        real = getattr(cpu_int8, name)
        monkeypatch.setattr(cpu_int8, name, lambda a, b, real=real, name=name: ran.append(name) or real(a, b))
    real_native = native.int8_product
    monkeypatch.setattr(native, "int8_product", lambda a, b: ran.append("native") or real_native(a, b))
    expected_fn = {"int_mm": "_int_mm_product", "fp32_chunks": "_fp32_product", "native": "native"}[kernel]
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
        assert names == ["int_mm", "native", "fp32_chunks"]
    for composite in ("w8a8_linear_from_float", "w8a8_static_linear_from_float"):
        names = [k.name for k in registry.kernels(composite, "cpu")]
        assert names == ["fused_native", "fused_int_mm", "fused_fp32_chunks"]


def test_profile_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SDKILN_CPU_MEASURE", raising=False)
    calls = []
    fake = {"int8:int_mm": 5.0, "int8:fp32_chunks": 1.0, "matmul:float32": 1.0, "matmul:bfloat16": 3.0}
    monkeypatch.setattr(cp, "measure_products", lambda: calls.append(1) or dict(fake))
    monkeypatch.setattr(cp, "inexact_products", lambda: ())
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


# The native kernels, every build this CPU runs, bit for bit against the references.


@pytest.fixture(params=list(native.VARIANTS))
def build(request, monkeypatch):
    """Each native build, where this CPU runs it, as the library the kernels call."""
    lib, st = native.load_variant(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} build does not run here: {st.detail}")
    monkeypatch.setattr(native, "_lib", lambda: lib)
    return request.param


def assert_same(got, expected):
    """Bit for bit, NaN where the reference has NaN (an inf activation makes its row's scale inf)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


SHAPES = [(1, 1, 1), (3, 17, 5), (5, 64, 4), (37, 130, 19), (2, 2500, 9), (16, 128, 128)]
"""M, K, N: every tile edge of both builds (M % 4, N % 4, K % 16 and K % 64 non-zero), one chunk
past the fp32 limit, and the embedded model's text layer."""


def activations(m, k, gen):
    x = torch.randn(m, k, generator=gen) * 3
    x[0, : min(k, 3)] = torch.tensor([0.5, -0.5, 2.5])[: min(k, 3)] * x[0].abs().max() / 127  # ties
    if m > 2:
        x[1] = 0.0  # an all-zero row: scale 1
        x[2, 0] = float("inf")  # torch's NaN/inf behaviour too
    return x


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_native_product_is_exact(build, m, k, n):
    gen = torch.Generator().manual_seed(m * k * n)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    a[0], b[0] = -128, -128  # the largest sums, and -128 on both sides
    assert torch.equal(native.int8_product(a, b), a.long().mm(b.long().T).to(torch.int32))


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_native_quantizers_and_dequantizers_are_exact(build, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    x = activations(m, k, gen)
    q, scale = native.quant_per_token(x)
    ref_q, ref_scale = int8.quantize_per_token_int8_reference(x)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    for s, o in [(0.02, 0.0), (0.05, -7.0), (0.01, 127.0)]:  # -128 comes out of the last two
        st, ot = torch.tensor([s]), torch.tensor([o])
        assert torch.equal(
            native.quant_per_tensor(x, s, o), int8.quantize_per_tensor_int8_reference(x, st, ot)
        )
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale, bias = torch.rand(n, generator=gen) / 100, torch.randn(n, generator=gen)
    acc = int8.int8_matmul(ref_q, w)
    for b in (bias, None):
        ref = int8.w8a8_linear_reference(ref_q, ref_scale, w, w_scale, b, torch.float32)
        assert_same(native.dequant_per_token(acc, ref_scale, w_scale, b), ref)
    qb = torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, generator=gen)
    ref = int8.w8a8_static_linear_reference(ref_q, w, w_scale, qb, torch.float32)
    assert_same(native.dequant_per_tensor(acc, qb, w_scale), ref)


def static_params(n, gen):
    return (
        torch.tensor([0.03]),
        torch.tensor([-5.0]),
        torch.rand(n, generator=gen) / 1000,
        torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, generator=gen),
    )


@pytest.mark.parametrize("kernel", cp.INT8_PRODUCTS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_fused_linears_run_and_are_exact(build, monkeypatch, kernel, m, k, n):
    """The composites as the W8A8 modules call them: the pretended product's fused kernel runs, and
    its output is the reference composition's bit for bit, for fp32 and bf16 activations, with and
    without bias, for a [..., K] and a non-contiguous input."""
    needs_native()
    monkeypatch.setattr(cp, "cpu_profile", lambda: pretend(VNNI).choosing(kernel))
    gen = torch.Generator().manual_seed(7 * m + k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale, bias = torch.rand(n, generator=gen) / 100, torch.randn(n, generator=gen)
    scale, offset, deq, qb = static_params(n, gen)
    x = activations(m, k, gen)
    inputs = [x, x.to(torch.bfloat16), x.reshape(1, m, k), torch.cat([x, x], 1)[:, ::2]]
    K.reset_kernel_counts()
    with torch.no_grad():
        for xi in inputs:
            for b in (bias, None):
                got = K.w8a8_linear_from_float(xi, w, w_scale, b)
                assert_same(got, int8.w8a8_linear_from_float_reference(xi, w, w_scale, b))
                assert got.dtype == xi.dtype and got.shape == (*xi.shape[:-1], n)
            got = K.w8a8_static_linear_from_float(xi, scale, offset, w, deq, qb)
            assert_same(got, int8.w8a8_static_linear_from_float_reference(xi, scale, offset, w, deq, qb))
    counts = K.kernel_counts()
    assert counts[("w8a8_linear_from_float", "cpu", f"fused_{kernel}")] == 2 * len(inputs)
    assert counts[("w8a8_static_linear_from_float", "cpu", f"fused_{kernel}")] == len(inputs)


def test_composites_run_their_reference_outside_plain_eager(monkeypatch):
    """With a gradient wanted, under a dispatch mode or with native kernels off, the composite runs its
    reference: the registered ops, dispatched and counted as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    w = torch.randint(-127, 128, (8, 32), dtype=torch.int8, generator=gen)
    ws = torch.rand(8, generator=gen) / 100
    expected = int8.w8a8_linear_from_float_reference(x, w, ws, None)
    inner = {("quantize_per_token_int8", "cpu", "reference"), ("w8a8_linear", "cpu", "int_mm")}
    monkeypatch.setattr(cp, "cpu_profile", lambda: pretend(VNNI).choosing("int_mm"))
    for context in ("grad", "mode", "off"):
        K.reset_kernel_counts()
        if context == "grad":
            out = K.w8a8_linear_from_float(x.clone().requires_grad_(), w, ws)
        elif context == "mode":
            with Seen():
                out = K.w8a8_linear_from_float(x, w, ws)
        else:
            monkeypatch.setattr(native, "available", lambda: False)
            out = K.w8a8_linear_from_float(x, w, ws)
        assert torch.equal(out.detach(), expected)
        assert set(K.kernel_counts()) == inner, context


def test_native_status_says_why_not(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        for env, why in [("0", "off (SDKILN_CPU_NATIVE=0)"), ("avx3", "SDKILN_CPU_NATIVE='avx3' is not")]:
            monkeypatch.setenv("SDKILN_CPU_NATIVE", env)
            native._load.cache_clear()
            assert not native.available() and native.status().detail.startswith(why)
        if native.variant(cp.read_cpu_info().features) is None:
            pytest.skip("the compiler cases need a CPU the AVX2 build runs on")
        monkeypatch.setenv("SDKILN_CPU_NATIVE", "avx2")
        monkeypatch.setenv("CC", "no-such-compiler")
        monkeypatch.setattr(native.shutil, "which", lambda name: None)
        native._load.cache_clear()
        native.load_variant.cache_clear()
        assert native.status().detail.startswith("no C compiler found")
        broken = tmp_path / "cc"
        broken.write_text("#!/bin/sh\necho 'error: nothing compiles here' >&2\nexit 1\n")
        broken.chmod(0o755)
        monkeypatch.setattr(native.shutil, "which", lambda name: str(broken))
        native._load.cache_clear()
        native.load_variant.cache_clear()
        assert native.status().detail == "build failed: cc failed: error: nothing compiles here"
        assert not list((tmp_path / "sdkiln" / "native").iterdir())  # nothing half-written left
    finally:
        native._load.cache_clear()
        native.load_variant.cache_clear()


def test_a_reloaded_family_keeps_its_composites_and_another_definition_is_refused():
    import importlib

    before = registry._COMPOSITES["w8a8_linear_from_float"]
    importlib.reload(int8)
    assert registry._COMPOSITES["w8a8_linear_from_float"] is before
    with pytest.raises(ValueError, match="already defined"):
        registry.define_composite("w8a8_linear_from_float", lambda *args: None)
