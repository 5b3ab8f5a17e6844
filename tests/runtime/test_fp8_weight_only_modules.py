"""FP8DynamicLinear, W8A16Linear and W4A16Linear: close to the float layer, Ascend tensor names and dtypes,
and an exact rebuild from their state dict on the meta device, as the loader does."""

import pytest
import torch
from torch import nn

from sdkiln.kernels.int4 import unpack_int4
from sdkiln.metrics import sqnr_db
from sdkiln.runtime.quant import quant_module, scheme_classes
from sdkiln.runtime.quant.fp8_dynamic import FP8DynamicLinear
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear

# Layer output SQNR against the float layer: Gaussian weights (std 0.05) and inputs, K=512, N=192.
# Measured over seeds 0-2: fp8 28.5 dB, w8a16 42.4 dB, w4a16 g64 19.2-19.3 dB, g128 18.4-18.6 dB.
SQNR_FLOOR_DB = {"fp8": 26.0, "w8a16": 38.0, "w4a16-g64": 17.0, "w4a16-g128": 16.0}

BUILDERS = {
    "fp8": FP8DynamicLinear.from_linear,
    "w8a16": W8A16Linear.from_linear,
    "w4a16-g64": lambda linear: W4A16Linear.from_linear(linear, group_size=64),
    "w4a16-g128": lambda linear: W4A16Linear.from_linear(linear, group_size=128),
}


def gaussian_linear(k=512, n=192, bias=True, dtype=torch.float32, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.05)
    return linear.to(dtype)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_close_to_the_float_layer(kind):
    linear = gaussian_linear(bias=False)
    x = torch.randn(4, 33, 512)
    with torch.no_grad():
        assert sqnr_db(linear(x), BUILDERS[kind](linear)(x)) > SQNR_FLOOR_DB[kind]


def test_smaller_groups_are_closer():
    linear = gaussian_linear(bias=False)
    x = torch.randn(4, 33, 512)
    with torch.no_grad():
        ref = linear(x)
        assert sqnr_db(ref, BUILDERS["w4a16-g64"](linear)(x)) > sqnr_db(
            ref, BUILDERS["w4a16-g128"](linear)(x)
        )


EXPECTED_TENSORS = {
    "fp8": {"weight": (torch.float8_e4m3fn, (192, 512)), "weight_scale": (torch.float32, (192, 1))},
    "w8a16": {
        "weight": (torch.int8, (192, 512)),
        "weight_scale": (torch.float32, (192, 1)),
        "weight_offset": (torch.float32, (192, 1)),
    },
    "w4a16-g128": {
        "weight": (torch.uint8, (192, 256)),
        "weight_scale": (torch.float32, (192, 4)),
        "weight_offset": (torch.float32, (192, 4)),
    },
}


@pytest.mark.parametrize("kind", list(EXPECTED_TENSORS))
def test_state_dict_names_dtypes_and_shapes(kind):
    q = BUILDERS[kind](gaussian_linear(dtype=torch.bfloat16))
    expected = {**EXPECTED_TENSORS[kind], "bias": (torch.bfloat16, (192,))}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in q.state_dict().items()} == expected
    if "weight_offset" in expected:
        assert not q.weight_offset.any()


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rebuilt_on_meta_from_params_is_exact(kind, dtype):
    """The loader's path: quant_module(scheme)(in, out, bias, dtype, "meta", **params), then assign."""
    q = BUILDERS[kind](gaussian_linear(dtype=dtype))
    assert scheme_classes()[q.scheme] is type(q) and quant_module(q.scheme) is type(q)
    rebuilt = quant_module(q.scheme)(512, 192, True, dtype, "meta", **q.params())
    rebuilt.load_state_dict(q.state_dict(), strict=True, assign=True)
    x = torch.randn(2, 7, 512, dtype=dtype)
    out = q(x)
    assert out.dtype == dtype and torch.equal(rebuilt(x), out)


def test_w8a16_weight_is_per_channel_symmetric():
    linear = gaussian_linear(k=64, n=32, bias=False)
    with torch.no_grad():
        linear.weight[3] = 0
    q = W8A16Linear.from_linear(linear)
    assert q.bias is None and q.params() == {}
    rows = torch.arange(32) != 3
    absmax = linear.weight.detach().abs().amax(1, keepdim=True)
    s = q.weight_scale[rows]  # int8_weight's grid: absmax / 127.5, rounded up to bf16 and fp16 values
    assert torch.equal(s, s.to(torch.bfloat16).float()) and torch.equal(s, s.half().float())
    assert (s >= absmax[rows] / 127.5).all() and (s <= absmax[rows] / 127.5 * (1 + 2**-7)).all()
    assert (q.weight.int().amax(1)[rows] <= 127).all() and (q.weight.int().amin(1)[rows] >= -128).all()
    assert (q.weight.int().abs().amax(1)[rows] >= 127).all()  # each row's largest weight spans the grid
    assert q.weight_scale[3].item() == 1.0 and not q.weight[3].any()
    # Error within half a step, except a row's largest positive weight (127.5 -> 127): a full half step.
    assert (q.weight.float() * q.weight_scale - linear.weight).abs().max() <= q.weight_scale.max() / 2 + 1e-7


def test_w4a16_weight_is_groupwise_symmetric_in_minus7_to_7():
    linear = gaussian_linear(k=256, n=16, bias=False)
    q = W4A16Linear.from_linear(linear, group_size=64)
    assert q.params() == {"group_size": 64}
    values = unpack_int4(q.weight).reshape(16, 4, 64)
    assert values.min() >= -7 and values.max() <= 7
    assert (values.abs().amax(-1) == 7).all()
    w = linear.weight.detach().reshape(16, 4, 64)
    assert torch.equal(q.weight_scale, w.abs().amax(-1) / 7)
    assert (values.float() * q.weight_scale.unsqueeze(-1) - w).abs().max() <= q.weight_scale.max() / 2 + 1e-7


@pytest.mark.parametrize("group_size", [0, 48, 65, "64"])
def test_w4a16_rejects_a_group_size_that_does_not_fit(group_size):
    with pytest.raises(ValueError, match="group_size must be a positive even divisor of in_features=128"):
        W4A16Linear(128, 8, False, group_size=group_size)


def test_w4a16_needs_its_group_size():
    with pytest.raises(TypeError, match="group_size"):
        quant_module("W4A16")(128, 8, False, torch.float32, "meta")
