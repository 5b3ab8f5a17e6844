"""The Ascend kernels against a recorded fake torch_npu: which torch_npu op each sdkiln op calls,
with which arguments, layouts and dtypes, and that the result matches the reference.

The fake implements each torch_npu op from its API reference (shapes and dtypes checked, the math
written from the documented formula), so a wrong transpose, scale shape or dtype fails here. It
cannot show that the real kernels behave as documented: that needs an Ascend machine
(``docs/ascend.md``).
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch

import sdkiln.kernels as K
from sdkiln.kernels import int4
from sdkiln.kernels.ops import int8, weight_only
from sdkiln.metrics import sqnr_db

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_torch_npu import HALF, FakeTorchNpu  # noqa: E402

# Kernel (through the fake) against the reference, signal-to-noise of the difference (STYLE habit 12).
KERNEL_VS_REFERENCE_MIN_SQNR_DB = 35.0


NPU_OPS = (
    "quantize_per_token_int8",
    "w8a8_linear",
    "quantize_per_tensor_int8",
    "w8a8_static_linear",
    "weight_only_linear",
)


def remove_npu_kernels() -> None:
    for op in NPU_OPS:
        if any(k.name == "torch_npu" for k in K.kernels(op, "npu")):
            K.remove_kernel(op, "npu", "torch_npu")


@pytest.fixture
def npu(monkeypatch):
    """The fake in sys.modules and the kernel modules imported against it (which registers them);
    no kernel stays registered afterwards."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    for name in ("sdkiln.kernels.npu.quant", "sdkiln.kernels.npu"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    remove_npu_kernels()
    assert K.load_device_kernels("npu") == ["sdkiln.kernels.npu"]
    yield fake, importlib.import_module("sdkiln.kernels.npu.quant")
    remove_npu_kernels()


def test_kernels_register_for_npu_only_and_come_out_again(npu):
    assert K.load_device_kernels("npu") == ["sdkiln.kernels.npu"]  # a second load is harmless
    for op in K.op_names():
        expected = "torch_npu" if op in NPU_OPS else "reference"
        assert K.implementation(op, "npu") == expected and K.implementation(op, "cpu") == "reference"
        assert [k.name for k in K.kernels(op, "npu")] == ([expected] if op in NPU_OPS else [])
    remove_npu_kernels()
    assert all(K.implementation(op, "npu") == "reference" for op in NPU_OPS)


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quantization_is_npu_dynamic_quant(npu, dtype):
    fake, quant = npu
    x = torch.randn(2, 5, 64).to(dtype)
    q, scale = quant.quantize_per_token_int8(x)
    ((op, args, kwargs),) = fake.calls
    assert op == "npu_dynamic_quant" and args[0].shape == (10, 64)
    ref_q, ref_scale = int8.quantize_per_token_int8_reference(x)
    assert q.shape == x.shape and scale.shape == (2, 5, 1)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_w8a8_linear_is_npu_quant_matmul_with_pertoken_scale(npu, dtype, with_bias):
    fake, quant = npu
    x_q, x_scale = int8.quantize_per_token_int8_reference(torch.randn(3, 4, 96))
    w = torch.randint(-127, 128, (48, 96), dtype=torch.int8)
    w_scale = torch.rand(48, 1) / 100 + 1e-3
    bias = torch.randn(48).to(dtype) if with_bias else None
    y = quant.w8a8_linear(x_q, x_scale, w, w_scale, bias, dtype)
    ((op, args, kwargs),) = fake.calls
    x1, x2, scale = args
    assert op == "npu_quant_matmul"
    assert x1.shape == (12, 96) and x2.shape == (96, 48)
    assert x2.data_ptr() == w.data_ptr() and x2.stride() == (1, 96), (
        "the weight goes in as a view, not a copy"
    )
    assert scale.shape == (48,) and kwargs["pertoken_scale"].shape == (12,)
    assert kwargs["output_dtype"] == dtype and kwargs["offset"] is None
    assert (kwargs["bias"] is None) == (bias is None)
    expected = int8.w8a8_linear_reference(x_q, x_scale, w, w_scale, bias, dtype)
    assert y.shape == expected.shape == (3, 4, 48) and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_static_quantization_is_npu_quantize_with_int8_offset(npu, dtype):
    fake, quant = npu
    x = (torch.randn(2, 7, 64) * 3).to(dtype)
    scale, offset = torch.tensor([0.05]), torch.tensor([-17.0])
    q = quant.quantize_per_tensor_int8(x, scale, offset)
    ((op, args, _),) = fake.calls
    assert op == "npu_quantize" and args[0] is x and args[3:] == (torch.qint8, -1, True)
    assert args[1].shape == args[2].shape == (1,) and args[2].dtype == torch.int8
    # npu_quantize documents round(x / s + o), the reference's order too: equal, ties included.
    assert torch.equal(q, int8.quantize_per_tensor_int8_reference(x, scale, offset))


@pytest.mark.parametrize("dtype", HALF)
def test_w8a8_static_linear_is_npu_quant_matmul_with_int32_bias(npu, dtype):
    fake, quant = npu
    x_q = torch.randint(-128, 128, (3, 5, 64), dtype=torch.int8)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    deq = torch.rand(32) / 1000 + 1e-4
    quant_bias = torch.randint(-5000, 5000, (32,), dtype=torch.int32)
    y = quant.w8a8_static_linear(x_q, w, deq, quant_bias, dtype)
    ((op, args, kwargs),) = fake.calls
    assert op == "npu_quant_matmul" and args[0].shape == (15, 64)
    assert args[1].data_ptr() == w.data_ptr() and args[1].shape == (64, 32)
    assert args[2] is deq and kwargs["bias"] is quant_bias and kwargs["pertoken_scale"] is None
    assert kwargs["output_dtype"] == dtype
    expected = int8.w8a8_static_linear_reference(x_q, w, deq, quant_bias, dtype)
    assert y.shape == expected.shape == (3, 5, 32) and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


@pytest.mark.parametrize("group_size", [0, 32], ids=["w8a16", "w4a16_g32"])
@pytest.mark.parametrize("dtype", HALF)
def test_weight_only_linear_is_npu_weight_quant_batchmatmul(npu, dtype, group_size):
    fake, quant = npu
    n, k = 40, 64
    x = torch.randn(2, 3, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    if group_size:
        weight = int4.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8))
        scale = torch.rand(n, k // group_size) / 10 + 1e-2
    else:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n, 1) / 100 + 1e-3
    y = quant.weight_only_linear(x, weight, scale, bias, group_size)
    names = [c[0] for c in fake.calls]
    call = fake.calls[-1]
    if group_size:
        assert names == ["npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"]
        assert fake.calls[0][1][0].shape == (n, k)  # int4 values one per int32, [N, K], packed by torch_npu
        assert call[1][1].shape == (k // 8, n)
    else:
        assert names == ["npu_weight_quant_batchmatmul"]
        assert call[1][1].data_ptr() == weight.data_ptr() and call[1][1].shape == (k, n)
    assert call[1][2].shape == ((k // group_size if group_size else 1), n)
    assert call[2]["antiquant_group_size"] == group_size
    expected = weight_only.weight_only_linear_reference(x, weight, scale, bias, group_size)
    assert y.shape == expected.shape and y.dtype == dtype
    assert sqnr_db(expected, y) > KERNEL_VS_REFERENCE_MIN_SQNR_DB


def test_float32_is_refused_not_rerouted(npu):
    _, quant = npu
    x_q, x_scale = int8.quantize_per_token_int8_reference(torch.randn(4, 32))
    w, w_scale = torch.ones(8, 32, dtype=torch.int8), torch.ones(8, 1)
    with pytest.raises(
        ValueError, match="w8a8_linear on Ascend: .*float16 or bfloat16 outputs, got torch.float32"
    ):
        quant.w8a8_linear(x_q, x_scale, w, w_scale, None, torch.float32)
    with pytest.raises(ValueError, match="quantize_per_token_int8 on Ascend"):
        quant.quantize_per_token_int8(torch.randn(4, 32))
    with pytest.raises(ValueError, match="w8a8_static_linear on Ascend"):
        quant.w8a8_static_linear(x_q, w, torch.ones(8), torch.zeros(8, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="weight_only_linear on Ascend"):
        quant.weight_only_linear(torch.randn(4, 32), w, w_scale, None, 0)
