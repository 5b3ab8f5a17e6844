"""The static int8 ops against their formulas, exactly, on every device present."""

import pytest
import torch

import sdkiln.kernels as K

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_per_tensor_int8_is_the_formula(device, dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 33, 64) * 3).to(dtype)
    scale, offset = torch.tensor([0.021]), torch.tensor([-17.0])
    q = K.quantize_per_tensor_int8(x.to(device), scale.to(device), offset.to(device))
    expected = torch.round(x.float() / scale + offset).clamp(-128, 127).to(torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q.cpu(), expected)
    assert q.min() == -128 and q.max() == 127  # both ends are reached and kept


@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_w8a8_static_linear_is_the_formula(device, out_dtype):
    torch.manual_seed(1)
    x_q = torch.randint(-128, 128, (3, 7, 96), dtype=torch.int8)
    w = torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    deq = torch.rand(40) * 1e-3
    qb = torch.randint(-50000, 50000, (40,), dtype=torch.int32)
    y = K.w8a8_static_linear(x_q.to(device), w.to(device), deq.to(device), qb.to(device), out_dtype)
    acc = x_q.to(torch.int64) @ w.to(torch.int64).T + qb
    assert y.dtype == out_dtype and torch.equal(y.cpu(), (acc.float() * deq).to(out_dtype))


def test_static_ops_reject_bad_inputs():
    x_q, w = torch.zeros(2, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)
    deq, qb = torch.ones(4), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="quant_bias must be torch.int32"):
        K.w8a8_static_linear(x_q, w, deq, qb.float())
    with pytest.raises(ValueError, match=r"must be \[N=4\]"):
        K.w8a8_static_linear(x_q, w, deq[:3], qb)
    with pytest.raises(ValueError, match="K = x_q.shape"):
        K.w8a8_static_linear(x_q[:, :4], w, deq, qb)
    with pytest.raises(ValueError, match="offset must be one float32 value"):
        K.quantize_per_tensor_int8(torch.zeros(3), torch.ones(1), torch.zeros(1, dtype=torch.int32))
