"""fp8_quantize_per_token, fp8_linear, weight_only_linear and the int4 storage format, against
independent formulas on every device present. Schema/fake/dispatch checks (opcheck) run for these
ops with the others in test_ops.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import sdkiln.kernels as K
from sdkiln.kernels.cuda import scaled_mm
from sdkiln.kernels.int4 import pack_int4, unpack_int4
from sdkiln.kernels.ops import fp8, weight_only
from sdkiln.metrics import sqnr_db

# Tolerances, stated once (STYLE habit 12).
# Exact (torch.equal): fp8 quantization against its formula; fp8_linear against an int64 matmul of
# the fp8 values scaled to integers; dequantized weights; int4 pack/unpack.
# weight_only_linear against F.linear on an independently dequantized weight: both are fp32
# matmuls that may sum in different orders, so fp32 within 1e-5, then one rounding to x's dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}
# The scaled_mm kernel (torch._scaled_mm, row-wise scales, bfloat16 out) against the exact reference:
# both round to bfloat16 once, but Hopper's fp8 tensor cores accumulate with fewer bits than fp32, so
# an elementwise bound fails on outputs near zero (seen on an H100: max relative difference 0.13);
# the signal-to-noise of the whole output is the measure (STYLE.md: kernel vs reference > 35 dB).
SCALED_MM_VS_REFERENCE_MIN_SQNR_DB = 35.0
# Quantized against float, signal-to-quantization-noise ratio on Gaussian data (3 mantissa bits give
# about 31.6 dB for the values alone, and 28.5 dB for a layer quantizing both operands):
FP8_QUANTIZE_MIN_SQNR_DB = 29.0
FP8_LINEAR_VS_FLOAT_MIN_SQNR_DB = 26.0
FP8_MAX = 448.0
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp8_quantize_per_token(device, dtype):
    x = randn(3, 4, 64, device=device, dtype=dtype, scale=3.0)
    x[1, 2] = 0
    q, s = K.fp8_quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (3, 4, 1)

    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    scale[scale == 0] = 1
    assert torch.equal(s, scale)
    assert torch.equal(q.float(), torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float())

    assert (q[1, 2].float() == 0).all() and s[1, 2].item() == 1.0
    nonzero = torch.ones(3, 4, dtype=torch.bool)
    nonzero[1, 2] = False
    assert (q.float().abs().amax(-1)[nonzero] == FP8_MAX).all()
    assert sqnr_db(xf, q.float() * s) > FP8_QUANTIZE_MIN_SQNR_DB


def test_fp8_quantize_never_makes_nan_and_guards_underflow(device):
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0], [1e-44, 0, 0, 0], [448.0, 449.0, 460.0, 465.0]], device=device)
    q, s = K.fp8_quantize_per_token(x)
    assert not q.float().isnan().any()
    assert q[0, :2].float().tolist() == [FP8_MAX, -FP8_MAX] and s[1].item() == 1.0
    assert (q[1].float() == 0).all()


def fp8_linear_by_hand(xq, xs, wq, ws, bias, out_dtype):
    """The documented formula with the exact product done independently: every e4m3fn value times
    2**9 is an integer, so an int64 matmul of those integers divided by 2**18 is the exact product."""
    a = (xq.reshape(-1, xq.shape[-1]).cpu().float() * 512).long()
    b = (wq.cpu().float() * 512).long()
    acc = (a @ b.T).double() / 2**18
    y = acc.float().to(xq.device) * xs.reshape(-1, 1)
    y = y * ws.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*xq.shape[:-1], -1)


def fp8_operands(m, k, n, device):
    x, w, b = randn(2, m, k, device=device), randn(n, k, device=device, scale=0.05), randn(n, device=device)
    return x, w, b, *K.fp8_quantize_per_token(x), *K.fp8_quantize_per_token(w)


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_fp8_linear_is_exact(device, out_dtype, with_bias):
    _, _, b, xq, xs, wq, ws = fp8_operands(4, 384, 48, device)
    bias = b.to(out_dtype) if with_bias else None
    out = K.fp8_linear(xq, xs, wq, ws, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (2, 4, 48)
    assert torch.equal(out, fp8_linear_by_hand(xq, xs, wq, ws, bias, out_dtype))
    assert torch.equal(K.fp8_linear(xq[:1, :1], xs[:1, :1], wq, ws, bias, out_dtype), out[:1, :1])


def test_fp8_linear_scaled_mm_kernel(device):
    """The CUDA kernel of fp8_linear, torch._scaled_mm with row-wise scales, against the reference.

    On a GPU of compute capability >= 8.9 it is loaded, asserted to be what runs, and measured
    through the op. Elsewhere the kernel function is called directly (``_scaled_mm`` runs on CPU
    too), so its argument mapping is checked on every machine; NPUs have no ``_scaled_mm``.
    """
    if device.type == "npu":
        pytest.skip("torch._scaled_mm does not run on NPUs")
    _, _, b, xq, xs, wq, ws = fp8_operands(16, 256, 64, device)
    args = (xq, xs, wq, ws, b.bfloat16(), torch.bfloat16)
    expected = fp8.fp8_linear_reference(*args)
    if device.type == "cuda":
        K.load_device_kernels("cuda")
        fits = torch.cuda.get_device_capability(device) >= scaled_mm.FP8_MIN_CAPABILITY
        assert K.implementation("fp8_linear", "cuda", *args) == ("scaled_mm" if fits else "reference")
        if not fits:
            pytest.skip("torch._scaled_mm needs compute capability >= 8.9")
        got = K.fp8_linear(*args)
    else:
        assert not scaled_mm.supports_scaled_mm(*args)  # CPU tensors: the dispatcher would not pick it
        got = scaled_mm.fp8_linear_scaled_mm(*args)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape == (2, 16, 64)
    assert sqnr_db(expected, got) > SCALED_MM_VS_REFERENCE_MIN_SQNR_DB


def test_scaled_mm_supports_only_what_its_row_wise_path_takes(monkeypatch):
    """On a (pretended) capability-9.0 GPU: bfloat16 output, K and N multiples of 16, a bfloat16
    bias or none; anything else falls back to the reference. The predicate reads only the
    activation's device, so a stand-in carries it."""
    monkeypatch.setattr(scaled_mm, "_capability", lambda index: (9, 0))
    _, _, b, _, xs, wq, ws = fp8_operands(4, 256, 64, "cpu")
    xq = SimpleNamespace(device=torch.device("cuda", 0))
    assert scaled_mm.supports_scaled_mm(xq, xs, wq, ws, b.bfloat16(), torch.bfloat16)
    assert scaled_mm.supports_scaled_mm(xq, xs, wq, ws, None, torch.bfloat16)
    assert not scaled_mm.supports_scaled_mm(xq, xs, wq, ws, None, torch.float32)
    assert not scaled_mm.supports_scaled_mm(xq, xs, wq, ws, b.float(), torch.bfloat16)
    assert not scaled_mm.supports_scaled_mm(xq, xs, wq[:40], ws[:40], None, torch.bfloat16)
    monkeypatch.setattr(scaled_mm, "_capability", lambda index: (8, 0))
    assert not scaled_mm.supports_scaled_mm(xq, xs, wq, ws, None, torch.bfloat16)


def test_fp8_linear_vs_float_linear(device):
    x, w, b, xq, xs, wq, ws = fp8_operands(16, 256, 64, device)
    assert sqnr_db(F.linear(x, w), K.fp8_linear(xq, xs, wq, ws)) > FP8_LINEAR_VS_FLOAT_MIN_SQNR_DB


def test_fp8_linear_rejects_bad_inputs():
    xq, xs = K.fp8_quantize_per_token(torch.randn(2, 8))
    wq, ws = K.fp8_quantize_per_token(torch.randn(3, 8))
    with pytest.raises(ValueError, match="x_q must be torch.float8_e4m3fn"):
        K.fp8_linear(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="weight must be torch.float8_e4m3fn"):
        K.fp8_linear(xq, xs, torch.zeros(3, 8, dtype=torch.int8), ws)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\]"):
        K.fp8_linear(xq, xs, wq[:, :4], ws)
    with pytest.raises(ValueError, match="x_scale"):
        K.fp8_linear(xq, xs[:1], wq, ws)
    with pytest.raises(ValueError, match=r"weight_scale must be \[N, 1\]"):
        K.fp8_linear(xq, xs, wq, ws.flatten())
    k = fp8.FP8_MAX_K + 1
    big = torch.zeros(1, k, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no longer exact"):
        K.fp8_linear(big, xs[:1], big, ws[:1])


def test_int4_nibble_order():
    """Element 2j in the low nibble of byte j, element 2j+1 in the high nibble, two's complement."""
    packed = pack_int4(torch.tensor([[1, -2, 7, -8], [0, -1, -7, 3]], dtype=torch.int8))
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xE1, 0x87], [0xF0, 0x39]]


def test_int4_pack_unpack_round_trip(device):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128).to(device)
    values = unpack_int4(every_byte)
    assert values.dtype == torch.int8 and values.shape == (2, 256)
    assert values.min() == -8 and values.max() == 7
    assert torch.equal(pack_int4(values), every_byte)
    random = torch.randint(-8, 8, (3, 5, 64), dtype=torch.int8).to(device)
    assert torch.equal(unpack_int4(pack_int4(random)), random)


def test_int4_pack_rejects_what_it_cannot_store():
    with pytest.raises(ValueError, match=r"in \[-8, 7\]"):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="must be torch.int8"):
        pack_int4(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="must be torch.uint8"):
        unpack_int4(torch.zeros(2, 4, dtype=torch.int8))


def dequantize_by_hand(values, scale, group_size):
    """Independent of the reference: scales repeated along K rather than groups reshaped."""
    return values.float() * (scale.repeat_interleave(group_size, dim=1) if group_size else scale)


# (bits, group_size): per-channel and grouped int8, grouped and per-channel int4.
WEIGHT_FORMATS = [(8, 0), (8, 32), (4, 64), (4, 128), (4, 0)]


def weight_only_operands(bits, group_size, k, n, device):
    groups = k // group_size if group_size else 1
    lo, hi = (-8, 8) if bits == 4 else (-127, 128)
    values = torch.randint(lo, hi, (n, k), dtype=torch.int8).to(device)
    scale = (torch.rand(n, groups) * 0.01 + 1e-3).to(device)
    weight = pack_int4(values) if bits == 4 else values
    return values, weight, scale


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bits, group_size", WEIGHT_FORMATS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_weight_only_linear(device, dtype, bits, group_size, with_bias):
    values, weight, scale = weight_only_operands(bits, group_size, 256, 48, device)
    x = randn(2, 5, 256, device=device, dtype=dtype)
    bias = randn(48, device=device, dtype=dtype) if with_bias else None
    w = dequantize_by_hand(values, scale, group_size)
    assert torch.equal(weight_only.dequantize_weight(weight, scale, group_size), w)
    out = K.weight_only_linear(x, weight, scale, bias, group_size)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    expected = F.linear(x.float(), w, None if bias is None else bias.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_weight_only_linear_rejects_bad_inputs():
    x = torch.randn(2, 64)
    values, weight, scale = weight_only_operands(4, 32, 64, 3, "cpu")
    with pytest.raises(ValueError, match="x must be a float tensor"):
        K.weight_only_linear(x.to(torch.int8), weight, scale, None, 32)
    with pytest.raises(ValueError, match="weight must be torch.int8 .* or torch.uint8"):
        K.weight_only_linear(x, weight.float(), scale, None, 32)
    with pytest.raises(ValueError, match=r"torch.uint8 weight must be \[N, K/2\]"):
        K.weight_only_linear(x, values.view(torch.uint8), scale, None, 32)
    with pytest.raises(ValueError, match=r"torch.int8 weight must be \[N, K\]"):
        K.weight_only_linear(x, weight.view(torch.int8), scale, None, 32)
    with pytest.raises(ValueError, match="group_size must be 0 .* or divide K=64"):
        K.weight_only_linear(x, weight, scale, None, 24)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[N, 2\]"):
        K.weight_only_linear(x, weight, scale[:, :1], None, 32)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[N, 1\]"):
        K.weight_only_linear(x, weight, scale, None, 0)


def test_fp8_and_weight_only_ops_refuse_backward():
    x = torch.randn(4, 16, requires_grad=True)
    _, s = K.fp8_quantize_per_token(x)
    with pytest.raises(RuntimeError, match="no gradient"):
        s.sum().backward()
    values, weight, scale = weight_only_operands(8, 0, 16, 3, "cpu")
    with pytest.raises(RuntimeError, match="no gradient"):
        K.weight_only_linear(x, weight, scale).sum().backward()


def test_fp8_linear_neither_mutates_nor_aliases_its_inputs(device):
    """What opcheck's test_schema would check, which cannot compare float8 tensors."""
    _, _, b, xq, xs, wq, ws = fp8_operands(3, 64, 8, device)
    inputs = (xq, xs, wq, ws, b)
    before = [t.clone() for t in inputs]
    out = K.fp8_linear(*inputs)
    for t, saved in zip(inputs, before, strict=True):
        assert torch.equal(t.view(torch.uint8), saved.view(torch.uint8))
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
