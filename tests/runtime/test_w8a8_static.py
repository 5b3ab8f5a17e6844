"""W8A8 static: the runtime module against the issue's formulas computed independently, and against
the float layer on calibration-like data."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdkiln import kernels
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.quant import Ranges, quant_module
from sdkiln.runtime.quant.smooth import SmoothedLinear
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear

# Quantized layer vs its float layer, on inputs from the distribution the range was calibrated on
# (post-GELU-like: skewed, channels of growing scale). int8's usual floor is 20 dB; this layer
# measures 50.4 dB, and the floor keeps a 10 dB margin.
STATIC_MIN_SQNR_DB = 40.0


def activations(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = F.gelu(torch.randn(n, k, generator=g) * 2 + 0.5)
    return x * torch.linspace(0.5, 3.0, k)


def bf16_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= v (all values here are float16-normal, so float16 holds it too)."""
    b = v.to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    return torch.where(b.float() < v, up, b).float()


def fp19_round(v: torch.Tensor) -> torch.Tensor:
    """v rounded to 10 mantissa bits (CANN's fp19)."""
    step = torch.exp2(torch.floor(torch.log2(v.double())) - 10)
    return (torch.round(v.double() / step) * step).float()


def issue_formula(linear: nn.Linear, lo: float, hi: float, x: torch.Tensor):
    """The issue's W8A8 formulas with the Ascend grids (the scales bfloat16- and float16-exact,
    deq_scale fp19), written independently of sdkiln (float64 / int64 where exact)."""
    w = linear.weight.detach()
    s_w = bf16_ceil(w.abs().amax(1) / 127.5)  # W8A8_DYNAMIC's per-channel weight scale, fp32
    wq = torch.round(w / s_w[:, None]).clamp(-128, 127).to(torch.int64)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    s_x = bf16_ceil(torch.tensor((hi - lo) / 255, dtype=torch.float32))
    o_x = torch.tensor(round(-lo / float(s_x)) - 128, dtype=torch.float32)
    deq = fp19_round(s_x * s_w)
    qb = torch.round(linear.bias.double() / deq.double() - o_x.double() * wq.sum(1).double()).to(torch.int64)
    x_q = torch.round(x / s_x + o_x).clamp(-128, 127).to(torch.int64)
    y = ((x_q @ wq.T + qb).float() * deq).to(x.dtype)
    return {
        "weight": wq.to(torch.int8),
        "input_scale": s_x,
        "input_offset": o_x,
        "deq_scale": deq,
        "quant_bias": qb,
    }, y


def test_static_layer_equals_the_issue_formulas():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    calib = activations(512, 96, seed=1)
    lo, hi = float(calib.min()), float(calib.max())
    q = W8A8StaticLinear.from_linear(linear, Ranges(lo, hi))
    x = activations(64, 96, seed=2) * 1.3  # some values beyond the range: the clamp matters
    expected, y = issue_formula(linear, lo, hi, x)
    assert torch.equal(q.weight, expected["weight"])
    assert torch.equal(q.input_scale, expected["input_scale"].reshape(1))
    assert torch.equal(q.input_offset, expected["input_offset"].reshape(1))
    assert torch.equal(q.deq_scale, expected["deq_scale"])
    assert torch.equal(q.quant_bias, expected["quant_bias"].to(torch.int32))
    assert q.quant_bias.dtype == torch.int32 and q.weight.dtype == torch.int8
    assert torch.equal(q.bias, linear.bias.detach())
    with torch.no_grad():
        assert torch.equal(q(x), y)


def test_static_layer_is_close_to_the_float_layer_and_adds_the_bias_once():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    with torch.no_grad():
        linear.bias.fill_(5.0)  # counted twice it would dominate the error
    calib = activations(2048, 256, seed=3)
    q = W8A8StaticLinear.from_linear(linear, Ranges(float(calib.min()), float(calib.max())))
    x = activations(256, 256, seed=4)
    with torch.no_grad():
        assert sqnr_db(linear(x), q(x)) > STATIC_MIN_SQNR_DB


def test_offset_holds_zero_and_an_all_zero_range_is_harmless():
    linear = nn.Linear(8, 4)
    positive = W8A8StaticLinear.from_linear(linear, Ranges(0.5, 2.0))  # the range is widened to [0, 2]
    assert positive.input_offset.item() == -128 and positive.input_scale.item() == bf16_ceil(
        torch.tensor(2 / 255)
    )
    zero = W8A8StaticLinear.from_linear(linear, Ranges(0.0, 0.0))
    assert zero.input_scale.item() == 1.0
    with torch.no_grad():
        torch.testing.assert_close(
            zero(torch.zeros(2, 8)), linear.bias.detach().expand(2, 4), atol=1e-2, rtol=0
        )


def test_quant_bias_that_could_overflow_is_refused():
    linear = nn.Linear(8, 4)
    with torch.no_grad():
        linear.bias.fill_(1e9)
    with pytest.raises(ValueError, match="beyond what an int32 accumulator"):
        W8A8StaticLinear.from_linear(linear, Ranges(-1e-3, 1e-3))


def test_quantize_per_tensor_adds_the_offset_then_rounds_half_to_even_and_clamps():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, 1000.0, -1000.0])
    q = kernels.quantize_per_tensor_int8(x, torch.tensor([1.0]), torch.tensor([3.0]))
    assert q.tolist() == [4, 4, 6, 2, 127, -128]  # round(x + 3), as npu_quantize documents
    with pytest.raises(ValueError, match="one float32 value"):
        kernels.quantize_per_tensor_int8(x, torch.tensor([1.0, 2.0]), torch.tensor([0.0]))


def test_smoothed_layer_keeps_the_ascend_names_and_rebuilds_on_meta():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    s = torch.rand(16) + 0.5
    smoothed = SmoothedLinear.from_linear(linear, s)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(x), linear(x), atol=1e-5, rtol=1e-5)
    smoothed.linear = W8A8StaticLinear.from_linear(smoothed.linear, Ranges(-3.0, 3.0))
    keys = set(smoothed.state_dict())
    assert keys == {
        "div.mul_scale",
        *(
            f"linear.{n}"
            for n in ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias", "bias")
        ),
    }
    rebuilt = SmoothedLinear(quant_module("W8A8")(16, 8, True, torch.float32, "meta"), 16, "meta")
    rebuilt.load_state_dict(smoothed.state_dict(), assign=True)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), smoothed(x))
