"""SmoothQuant on flux-tiny: exact in float where it folds and where it keeps a multiplier, which layers
do which, the alpha search, and the recipe rules around it."""

import copy

import pytest
import torch

from sdkiln.configs import RecipeConfig, SmoothQuantConfig, W8A8StaticConfig
from sdkiln.errors import RecipeError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.layers import select_layers
from sdkiln.optimizer.quant.calibration import STATS_FILE
from sdkiln.optimizer.quant.smoothquant import apply_smoothing, smoothing_groups
from sdkiln.optimizer.recipes import resolve_recipe
from sdkiln.optimizer.registry import TransformContext, apply_transform
from sdkiln.runtime.quant.smooth import SmoothedLinear
from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear

# Smoothing is an identity in exact arithmetic; in fp32 the transformer's output may move by rounding only.
FLOAT_TOL = dict(atol=1e-5, rtol=1e-5)

# (block list, modulation, the Linears that read its output), in every block of the list.
FOLDED = [
    ("transformer_blocks", "norm1.linear", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("transformer_blocks", "norm1.linear", ("ff.net.0.proj",)),
    ("transformer_blocks", "norm1_context.linear", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("transformer_blocks", "norm1_context.linear", ("ff_context.net.0.proj",)),
    ("single_transformer_blocks", "norm.linear", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
]
MUL_SCALE = [f"transformer_blocks.{i}.{n}" for i in (0, 1) for n in ("attn.to_out.0", "attn.to_add_out")]
MUL_SCALE += [f"transformer_blocks.{i}.{n}" for i in (0, 1) for n in ("ff.net.2", "ff_context.net.2")]
MUL_SCALE += [f"single_transformer_blocks.{i}.proj_out" for i in (0, 1)]


@pytest.fixture(scope="module")
def spec():
    return get_spec("flux-tiny")


def pipeline_and_input(spec):
    """A fresh flux-tiny pipeline and the transformer's keyword inputs at its first call."""
    pipe = spec.build()
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("kwargs", {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        pipe(prompt="a city at night", **{**spec.call_kwargs(), "output_type": "latent"})
    handle.remove()
    return pipe, captured["kwargs"]


def output(transformer, kwargs):
    with torch.inference_mode():
        return transformer(**kwargs)[0]


def test_flux_folds_into_the_modulations_and_keeps_multipliers_elsewhere(spec):
    pipe, kwargs = pipeline_and_input(spec)
    original = copy.deepcopy(pipe.transformer)
    ctx = TransformContext(pipeline=pipe, spec=spec, forward_loop=None)
    targets, _ = select_layers(ctx, ())
    groups = smoothing_groups(ctx, [t.layer for t in targets])
    expected = {
        (f"{bl}.{i}.{source}", tuple(f"{bl}.{i}.{c}" for c in consumers))
        for bl, source, consumers in FOLDED
        for i in (0, 1)
    }
    assert {(g.source, tuple(g.layers)) for g in groups if g.fold} == expected
    assert sorted(g.layers[0] for g in groups if not g.fold) == sorted(MUL_SCALE)

    gen = torch.Generator().manual_seed(0)
    for g in groups:  # factors far from 1 (about 0.05 to 20) so a wrong fold could not hide
        k = pipe.transformer.get_submodule(g.layers[0]).in_features
        apply_smoothing(pipe.transformer, g, torch.exp(1.5 * torch.randn(k, generator=gen)))
    assert sum(isinstance(m, SmoothedLinear) for m in pipe.transformer.modules()) == len(MUL_SCALE)
    torch.testing.assert_close(output(pipe.transformer, kwargs), output(original, kwargs), **FLOAT_TOL)


def test_the_step_keeps_the_float_model_and_records_its_search(spec):
    pipe, kwargs = pipeline_and_input(spec)
    reference = output(pipe.transformer, kwargs)
    result = apply_transform(
        TransformContext(pipeline=pipe, spec=spec, forward_loop=None), SmoothQuantConfig(calib_samples=1)
    )
    torch.testing.assert_close(output(pipe.transformer, kwargs), reference, **FLOAT_TOL)
    record, stats = result.record, result.files[STATS_FILE]
    for group in record["groups"]:
        errors = group["errors"]
        chosen = "none" if group["alpha"] is None else str(group["alpha"])
        assert errors[chosen] == min(errors.values())
        assert set(errors) == {"none", *map(str, SmoothQuantConfig().alphas)}
    for layer in record["mul_scale"]:
        mul = pipe.transformer.get_submodule(layer).div.mul_scale
        torch.testing.assert_close(stats[f"smoothquant/{layer}.smooth_scale"], 1 / mul)
    assert set(record["folded"]) | set(record["mul_scale"]) | set(record["unsmoothed"]) == {
        t.layer for t in select_layers(TransformContext(pipe, spec, None), ())[0]
    }
    assert (
        result.modules == {} and result.files["calibration/config.json"]["smoothquant"]["loop"] == "default"
    )
    assert record["alpha_search_data"]["seeds"] == [1]  # held out from the statistics' seed 0


def test_an_outlier_channel_is_smoothed_and_its_error_drops(spec):
    pipe = spec.build()
    with torch.no_grad():  # one channel of ff.net.2's input 30x larger than the rest
        proj = pipe.transformer.get_submodule("transformer_blocks.0.ff.net.0.proj")
        proj.weight[7] *= 30
        proj.bias[7] = 30 * proj.bias[7].abs() + 30
    result = apply_transform(TransformContext(pipe, spec, None), SmoothQuantConfig(calib_samples=1))
    (group,) = [g for g in result.record["groups"] if g["layers"] == ["transformer_blocks.0.ff.net.2"]]
    assert group["alpha"] is not None
    assert group["errors"][str(group["alpha"])] < 0.5 * group["errors"]["none"]


def test_smoothquant_needs_an_int8_step_after_it_with_the_same_excludes(spec):
    with pytest.raises(RecipeError, match="only prepares w8a8_static or w8a8_timestep or w8a8_dynamic"):
        resolve_recipe("smoothquant")
    with pytest.raises(RecipeError, match="only prepares"):
        resolve_recipe("smoothquant+w8a16")
    with pytest.raises(RecipeError, match="only prepares"):
        RecipeConfig("x", [W8A8StaticConfig(), SmoothQuantConfig()])
    with pytest.raises(RecipeError, match="targets 'w8a8_dynamic' but the recipe applies 'w8a8_static'"):
        RecipeConfig("x", [SmoothQuantConfig(target="w8a8_dynamic"), W8A8StaticConfig()])
    with pytest.raises(ValueError, match="target must be one of"):
        SmoothQuantConfig(target="w8a16")
    # the recipe tells the step which int8 layer its alpha search scores, without editing the step
    for name, target in [
        ("w8a8-static+smoothquant", "w8a8_static"),
        ("smoothquant+w8a8-timestep", "w8a8_timestep"),
        ("w8a8-dynamic+smoothquant", "w8a8_dynamic"),
    ]:
        recipe = resolve_recipe(name)
        assert [s.kind for s in recipe.steps] == ["smoothquant", target]
        assert recipe.target_of(recipe.steps[0]) == target and recipe.steps[0].target is None
        again = RecipeConfig.from_dict(recipe.to_dict())
        assert again == recipe and again.target_of(again.steps[0]) == target

    pipe = spec.build()
    ctx = TransformContext(pipe, spec, None)
    record = apply_transform(ctx, SmoothQuantConfig(calib_samples=1)).record
    with pytest.raises(ValueError, match="smoothed with an input multiplier"):
        apply_transform(ctx, W8A8StaticConfig(calib_samples=1, exclude=(record["mul_scale"][0],)))
    with pytest.raises(ValueError, match="already smoothed"):
        apply_transform(ctx, SmoothQuantConfig(calib_samples=1))


def test_before_w8a8_dynamic_alpha_is_scored_per_token_and_the_package_round_trips(spec, tmp_path):
    import numpy as np

    import sdkiln
    from sdkiln.configs import W8A8DynamicConfig
    from sdkiln.optimizer.evaluate import generate
    from sdkiln.runtime.quant.w8a8_dynamic import W8A8DynamicLinear

    pipe = spec.build()
    with torch.no_grad():  # the outlier channel of the test above
        proj = pipe.transformer.get_submodule("transformer_blocks.0.ff.net.0.proj")
        proj.weight[7] *= 30
        proj.bias[7] = 30 * proj.bias[7].abs() + 30
    ctx = TransformContext(pipe, spec, None)
    dynamic = apply_transform(ctx, SmoothQuantConfig(calib_samples=1, target="w8a8_dynamic")).record
    (group,) = [g for g in dynamic["groups"] if g["layers"] == ["transformer_blocks.0.ff.net.2"]]
    assert group["alpha"] is not None
    assert group["errors"][str(group["alpha"])] < 0.5 * group["errors"]["none"]
    # per-token scales already absorb part of what a static range cannot: the errors differ
    static = apply_transform(
        TransformContext(spec.build(), spec, None), SmoothQuantConfig(calib_samples=1)
    ).record
    assert [g["errors"] for g in static["groups"]] != [g["errors"] for g in dynamic["groups"]]

    recipe = RecipeConfig("sq-dyn", [SmoothQuantConfig(calib_samples=1), W8A8DynamicConfig()])
    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "pkg", eval_samples=0)
    modules = result.manifest["modules"]
    assert {e["scheme"] for e in modules.values()} == {"W8A8_DYNAMIC"}
    smoothed = [n for n, e in modules.items() if e.get("smooth")]
    assert smoothed and set(smoothed) == set(result.manifest["recipe"]["steps"][0]["result"]["mul_scale"])
    loaded = sdkiln.load(result.package, device="cpu")
    assert all(
        isinstance(loaded.transformer.get_submodule(f"{n}.linear"), W8A8DynamicLinear) for n in smoothed
    )
    call = spec.call_kwargs()
    prompts, seeds = list(spec.eval_prompts[:2]), [3, 4]
    img_mem, lat_mem = generate(result.pipeline, call, prompts, seeds)
    img_pkg, lat_pkg = generate(loaded, call, prompts, seeds)
    assert torch.equal(lat_mem, lat_pkg)
    assert np.array_equal(img_mem, img_pkg)


def test_a_later_step_leaves_alone_smoothed_layers_an_earlier_step_quantized():
    """A layer with an input multiplier whose inner Linear an earlier step quantized is no longer a
    candidate, even where a later step's excludes would keep it in float (that was refused before:
    'smoothed ... but this step keeps it in float'); a smoothed layer still in float is taken."""
    spec = get_spec("flux-tiny")
    pipe = spec.build()
    ctx = TransformContext(pipe, spec, None)
    model = pipe.transformer
    done, pending = "transformer_blocks.0.attn.to_out.0", "transformer_blocks.1.attn.to_out.0"
    for name in (done, pending):
        parent, _, leaf = name.rpartition(".")
        smoothed = SmoothedLinear.from_linear(model.get_submodule(name), torch.full((128,), 2.0))
        setattr(model.get_submodule(parent), leaf, smoothed)
    model.get_submodule(done).linear = W8A8DynamicLinear.from_linear(model.get_submodule(done).linear)
    targets, kept = select_layers(ctx, exclude=("transformer_blocks.0.*",))
    names = {t.layer: t for t in targets}
    assert done not in names and done not in kept
    assert names[pending].smoothed and names[pending].linear == f"{pending}.linear"
    with pytest.raises(ValueError, match=f"{pending} was smoothed .* keeps it in float"):
        select_layers(ctx, exclude=("transformer_blocks.1.*",))
