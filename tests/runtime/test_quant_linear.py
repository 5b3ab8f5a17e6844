import torch
from torch import nn

from sdkiln.runtime import W8A8Linear

SQNR_FLOOR_DB = 30.0  # W8A8 layer vs its float layer on random data


def sqnr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (test - ref).pow(2).sum()))


def test_w8a8_linear_close_to_float_linear():
    torch.manual_seed(0)
    linear = nn.Linear(256, 192)
    x = torch.randn(4, 33, 256)
    q = W8A8Linear.from_linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight_scale.shape == (192, 1)
    assert torch.equal(q.weight_offset, torch.zeros(192, 1))
    with torch.no_grad():
        assert sqnr_db(q(x), linear(x)) > SQNR_FLOOR_DB


def test_w8a8_linear_dequantized_weight_is_the_reference():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    q = W8A8Linear.from_linear(linear)
    dequant = q.weight.float() * q.weight_scale
    assert (dequant - linear.weight).abs().max() <= q.weight_scale.max() / 2 + 1e-7
    assert q.bias is None
