import pytest
import torch
from torch import nn

from sdkiln.metrics import sqnr_db
from sdkiln.runtime import W8A8DynamicLinear, W8A8Linear

SQNR_FLOOR_DB = 30.0  # W8A8 layer vs its float layer on random data


def test_w8a8_linear_close_to_float_linear():
    torch.manual_seed(0)
    linear = nn.Linear(256, 192)
    x = torch.randn(4, 33, 256)
    q = W8A8DynamicLinear.from_linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight_scale.shape == (192, 1)
    assert torch.equal(q.weight_offset, torch.zeros(192, 1))
    with torch.no_grad():
        assert sqnr_db(linear(x), q(x)) > SQNR_FLOOR_DB


def test_w8a8_linear_dequantized_weight_is_the_reference():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    q = W8A8DynamicLinear.from_linear(linear)
    dequant = q.weight.float() * q.weight_scale
    assert (dequant - linear.weight).abs().max() <= q.weight_scale.max() / 2 + 1e-7
    assert q.bias is None


def test_int8_weight_grid_is_absmax_over_127_5_rounded_up_to_half_exact_in_minus_128_to_127():
    from sdkiln.runtime.quant.w8a8_dynamic import int8_weight

    w = torch.tensor([[-2.0, 1.0, 0.5], [2.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    q, scale = int8_weight(w)
    # 2 / 127.5 = 0.0156862...: in [2**-6, 2**-5), where bfloat16's step is 2**-13; the next one up
    # from 2**-6 = 0.015625 is 2**-6 + 2**-13.
    up = 2**-6 + 2**-13
    assert torch.equal(scale, torch.tensor([[up], [up], [1.0]]))
    # 2 / s is just under 127.5 (the scale was rounded up): 127 at both ends; the others round
    # 1 / s = 63.5 and 0.5 / s = 31.75 half to even.
    assert q.tolist() == [[-127, 64, 32], [127, -64, 0], [0, 0, 0]]
    big = torch.randn(64, 256)
    q, scale = int8_weight(big)
    assert q.min() >= -128 and q.max() <= 127
    assert ((q.float() * scale - big).abs() <= scale / 2 + 1e-6).all()


def test_each_scheme_class_is_the_single_source_of_its_tables():
    """The loader's scheme map, quant_auto's candidates, the recipe kinds and the Ascend ranking are
    all read off the registered runtime classes."""
    from sdkiln.configs import RECIPE_STEPS, quant_auto_schemes
    from sdkiln.export.ascend import type_priority
    from sdkiln.runtime.quant import QuantLinear, by_recipe_kind, quant_module, scheme_classes

    classes = scheme_classes()
    assert set(classes) == {"W8A8_DYNAMIC", "W8A8", "W8A8_TIMESTEP", "FP8_DYNAMIC", "W8A16", "W4A16"}
    for scheme, cls in classes.items():
        assert issubclass(cls, QuantLinear) and quant_module(scheme) is cls and cls.scheme == scheme
        assert cls.recipe_kind in RECIPE_STEPS and by_recipe_kind()[cls.recipe_kind] is cls
        assert (cls.ascend_rank is None) == bool(cls.ascend_refusal)
    assert set(quant_auto_schemes()) == set(by_recipe_kind())
    assert type_priority() == ("FLOAT", "W8A16", "W8A8_DYNAMIC", "W8A8_TIMESTEP", "W8A8")
    assert W8A8Linear is classes["W8A8_DYNAMIC"]  # the old name still imports
    with pytest.raises(KeyError, match="this sdkiln runs FP8_DYNAMIC"):
        quant_module("W2A2")
