"""The fp8_dynamic, w8a16 and w4a16 steps on the tiny zoo models: which layers they swap, what they
record, and W4A16's rule for layers whose in_features is not a multiple of the group size."""

import pytest
from torch import nn

from sdkiln.configs import FP8DynamicConfig, W4A16Config, W8A16Config
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, apply_transform
from sdkiln.runtime.quant.fp8_dynamic import FP8DynamicLinear
from sdkiln.runtime.quant.weight_only import W4A16Linear, W8A16Linear


def context(name: str) -> TransformContext:
    spec = get_spec(name)
    return TransformContext(pipeline=spec.build(), spec=spec, forward_loop=None)


def test_named_recipes():
    assert resolve_recipe("fp8-dynamic").steps == [FP8DynamicConfig()]
    assert resolve_recipe("w8a16").steps == [W8A16Config()]
    assert resolve_recipe("w4a16").steps == [W4A16Config(group_size=128)]


@pytest.mark.parametrize(
    "config, cls, entry",
    [
        (FP8DynamicConfig(), FP8DynamicLinear, {"scheme": "FP8_DYNAMIC"}),
        (W8A16Config(), W8A16Linear, {"scheme": "W8A16"}),
        (W4A16Config(group_size=64), W4A16Linear, {"scheme": "W4A16", "group_size": 64}),
    ],
    ids=["fp8_dynamic", "w8a16", "w4a16"],
)
def test_swaps_every_block_linear_but_the_float_list(config, cls, entry):
    """A step that quantizes activations keeps the adaLN modulations (``weight_only_layers``) float;
    a weight-only step takes them (W4A16 where the group size divides their inputs)."""
    ctx = context("flux-tiny")
    block_linears = [
        n
        for n, m in ctx.transformer.named_modules()
        if isinstance(m, nn.Linear) and n.startswith(ctx.spec.block_prefixes())
    ]
    modulations = [
        n for n in block_linears if ctx.spec.is_float_layer(n) and not ctx.spec.is_float_layer(n, True)
    ]
    assert modulations  # FLUX's adaLN linears
    result = apply_transform(ctx, config)
    record = result.record
    weight_only = not cls.quantizes_activations
    assert record["quantized"]
    assert sorted(record["quantized"] + record["float"]) == sorted(block_linears)
    not_applicable = record.get("not_applicable", {})
    assert all(ctx.spec.is_float_layer(n, weight_only) or n in not_applicable for n in record["float"])
    if weight_only:
        assert set(modulations) - set(not_applicable) <= set(record["quantized"])
    else:
        assert set(modulations) <= set(record["float"])
    assert result.modules == {n: entry for n in record["quantized"]}
    model = ctx.transformer
    assert all(type(model.get_submodule(n)) is cls for n in record["quantized"])
    assert all(type(model.get_submodule(n)) is nn.Linear for n in record["float"])


def test_exclude_patterns_keep_layers_in_float():
    ctx = context("flux-tiny")
    result = apply_transform(ctx, W8A16Config(exclude=("single_transformer_blocks.*",)))
    assert result.record["quantized"] and not any(n.startswith("single_") for n in result.record["quantized"])
    assert any(n.startswith("single_transformer_blocks.") for n in result.record["float"])


def test_w4a16_keeps_and_records_layers_whose_in_features_the_group_does_not_divide():
    """sd3-tiny's block Linears take 64 or 256 inputs: with groups of 128 the 64-input ones stay float."""
    ctx = context("sd3-tiny")
    model = ctx.transformer
    with pytest.warns(
        UserWarning, match=r"w4a16: \d+ layers stay in float, .* not a multiple of group_size 128"
    ):
        result = apply_transform(ctx, W4A16Config(group_size=128))
    record = result.record
    assert record["group_size"] == 128 and record["not_applicable"]
    assert set(record["not_applicable"].values()) == {"in_features 64 is not a multiple of group_size 128"}
    assert set(record["not_applicable"]) <= set(record["float"])
    assert all(type(model.get_submodule(n)) is nn.Linear for n in record["not_applicable"])
    assert record["quantized"] and all(model.get_submodule(n).in_features == 256 for n in record["quantized"])


def test_w4a16_with_nothing_divisible_is_an_error():
    ctx = context("sd3-tiny")
    wide = [
        n for n, m in ctx.transformer.named_modules() if isinstance(m, nn.Linear) and m.in_features == 256
    ]
    with pytest.raises(
        ValueError,
        match=r"w4a16 cannot take any of the \d+ layers it found: in_features 64 is not a multiple of group_size 128",
    ):
        apply_transform(ctx, W4A16Config(group_size=128, exclude=tuple(wide)))


def test_a_step_with_nothing_to_quantize_is_an_error():
    ctx = context("flux-tiny")
    for config in (
        FP8DynamicConfig(exclude=("*",)),
        W8A16Config(exclude=("*",)),
        W4A16Config(exclude=("*",)),
    ):
        with pytest.raises(ValueError, match=f"{config.kind} found no float Linear layer"):
            apply_transform(ctx, config)


def test_w8a8_then_w8a16_gives_the_modulations_int8_weights_and_float_activations(
    tmp_path, assert_same_outputs
):
    """``w8a8-dynamic+w8a16``: the first step keeps FLUX's adaLN modulations float, the second takes
    exactly them; the package loads and generates what the optimized pipeline does."""
    import sdkiln

    result = sdkiln.optimize(
        "flux-tiny", "w8a8-dynamic+w8a16", tmp_path / "pkg", eval_samples=0, progress=False
    )
    spec = result.spec
    schemes = {n: e["scheme"] for n, e in result.manifest["modules"].items()}
    modulations = {n for n in schemes if spec.is_float_layer(n) and not spec.is_float_layer(n, True)}
    assert modulations and all(schemes[n] == "W8A16" for n in modulations)
    assert {s for n, s in schemes.items() if n not in modulations} == {"W8A8_DYNAMIC"}
    assert_same_outputs(result, sdkiln.load(result.package, device="cpu"))
