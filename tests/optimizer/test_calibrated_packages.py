"""W8A8 static and W8A8_TIMESTEP packages of flux-tiny, with and without SmoothQuant: exact round
trips, the stored tensors under their Ascend names, and calibration files that re-derive the scales."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import sdkiln
from sdkiln.calibrate.loop import prompts_sha256
from sdkiln.configs import Deployment, RecipeConfig, SmoothQuantConfig, W8A8StaticConfig, W8A8TimestepConfig
from sdkiln.errors import RecipeError, StepError
from sdkiln.model_zoo import get_spec
from sdkiln.optimizer.evaluate import generate
from sdkiln.optimizer.quant.w8a8_timestep import window_range
from sdkiln.runtime.denoising import step_tracker
from sdkiln.runtime.package import open_package
from sdkiln.runtime.quant.scales import half_exact
from sdkiln.runtime.quant.smooth import SmoothedLinear
from sdkiln.runtime.quant.w8a8_static import W8A8StaticLinear, activation_params
from sdkiln.runtime.quant.w8a8_timestep import W8A8TimestepLinear

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
SAMPLES = 1
RECIPES = {
    "w8a8-static": [W8A8StaticConfig(calib_samples=SAMPLES)],
    "w8a8-static+smoothquant": [
        SmoothQuantConfig(calib_samples=SAMPLES),
        W8A8StaticConfig(calib_samples=SAMPLES),
    ],
    "w8a8-timestep": [W8A8TimestepConfig(calib_samples=SAMPLES, dynamic_steps=(0, 2), step_window=1)],
    "smoothquant+w8a8-timestep": [
        SmoothQuantConfig(calib_samples=SAMPLES),
        W8A8TimestepConfig(calib_samples=SAMPLES, dynamic_steps=(0, 2)),
    ],
}
MODULE = {"w8a8_static": W8A8StaticLinear, "w8a8_timestep": W8A8TimestepLinear}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated")
    return {
        name: sdkiln.optimize(
            get_spec("flux-tiny").build(), RecipeConfig(name, steps), root / name, eval_samples=1
        )
        for name, steps in RECIPES.items()
    }


def quant_kind(result) -> str:
    return result.manifest["recipe"]["steps"][-1]["config"]["kind"]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_save_load_is_bit_identical(results, recipe, assert_same_outputs):
    result = results[recipe]
    loaded = sdkiln.load(result.package, device="cpu")
    modules = result.manifest["modules"]
    quantized = [m for m in loaded.transformer.modules() if type(m) is MODULE[quant_kind(result)]]
    smoothed = [m for m in loaded.transformer.modules() if isinstance(m, SmoothedLinear)]
    assert len(quantized) == len(modules) > 0
    assert len(smoothed) == sum(e.get("smooth", False) for e in modules.values())
    assert ("smoothquant" in recipe) == (len(smoothed) > 0)
    assert_same_outputs(result, loaded)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tensors_have_the_ascend_names_dtypes_and_shapes(results, recipe):
    result = results[recipe]
    model = result.base.transformer
    steps = 4 if "timestep" in recipe else None
    with safe_open(result.package / WEIGHTS, framework="pt") as fh:
        for layer, entry in result.manifest["modules"].items():
            n, k = model.get_submodule(layer).out_features, model.get_submodule(layer).in_features
            prefix = f"{layer}.linear" if entry.get("smooth") else layer
            lead = (steps,) if steps else ()
            expected = {
                "weight": ("I8", [n, k]),
                "input_scale": ("F32", [*lead, 1]),
                "input_offset": ("F32", [*lead, 1]),
                "deq_scale": ("F32", [*lead, n]),
                "quant_bias": ("I32", [*lead, n]),
                "bias": ("F32", [n]),
            }
            if steps:
                expected.update(weight_scale=("F32", [n, 1]), weight_offset=("F32", [n, 1]))
                assert entry == {
                    "scheme": "W8A8_TIMESTEP",
                    "num_steps": 4,
                    "dynamic_steps": entry["dynamic_steps"],
                } | ({"smooth": True} if entry.get("smooth") else {})
            for suffix, (dtype, shape) in expected.items():
                sl = fh.get_slice(f"{prefix}.{suffix}")
                assert (sl.get_dtype(), sl.get_shape()) == (dtype, shape), (layer, suffix)
            if entry.get("smooth"):
                sl = fh.get_slice(f"{layer}.div.mul_scale")
                assert (sl.get_dtype(), sl.get_shape()) == ("F32", [k])


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_calibration_files_rederive_the_activation_parameters(results, recipe):
    result = results[recipe]
    kind = quant_kind(result)
    stats = load_file(result.package / "calibration/stats.safetensors")
    tensors = load_file(result.package / WEIGHTS)
    config = json.loads((result.package / "calibration/config.json").read_text())
    assert {"calibration/stats.safetensors", "calibration/config.json"} <= set(
        open_package(result.package).manifest["files"]
    )
    assert set(config) == {s["config"]["kind"] for s in result.manifest["recipe"]["steps"]}
    record = config[kind]
    assert record["prompts_sha256"] == prompts_sha256(record["prompts"]) and record["seeds"] == [0]
    assert record["steps"] == 4 and record["resolution"] == {"height": 32, "width": 32}
    for layer, entry in result.manifest["modules"].items():
        prefix = f"{layer}.linear" if entry.get("smooth") else layer
        if kind == "w8a8_static":
            lo, hi = stats[f"{kind}/{layer}.min"], stats[f"{kind}/{layer}.max"]
        else:  # each step's range widened to its neighbours' by the recorded window
            window = next(
                s["result"]["step_window"]
                for s in result.manifest["recipe"]["steps"]
                if s["config"]["kind"] == kind
            )
            lo, hi = window_range(
                stats[f"{kind}/{layer}.step_min"], stats[f"{kind}/{layer}.step_max"], window
            )
            lo, hi = lo.reshape(4, 1), hi.reshape(4, 1)
        scale, offset = activation_params(lo, hi)
        assert torch.equal(scale, tensors[f"{prefix}.input_scale"])
        assert torch.equal(offset, tensors[f"{prefix}.input_offset"])
        if entry.get("smooth"):
            s = stats[f"smoothquant/{layer}.smooth_scale"]
            # the multiplier 1/s, on the grid MindIE SD's cast to bf16/fp16 leaves unchanged
            assert torch.equal(tensors[f"{layer}.div.mul_scale"], half_exact(1.0 / s, up=False))


def test_a_timestep_package_runs_only_at_its_step_count(results):
    result = results["w8a8-timestep"]
    step = result.manifest["recipe"]["steps"][-1]["result"]
    assert step["dynamic_steps"] in (0, 2) and set(step["dynamic_steps_search"]["errors"]) == {"0", "2"}
    loaded = sdkiln.load(result.package, device="cpu")
    assert step_tracker(loaded.transformer) is not None
    call = {**result.spec.call_kwargs(), "num_inference_steps": 6}
    with pytest.raises(StepError, match="calibrated for 4 denoising steps but the pipeline runs 6"):
        generate(loaded, call, ["a cat"], [0])


def test_a_user_forward_loop_is_run_and_recorded():
    runs = []
    call = {**get_spec("flux-tiny").call_kwargs(), "num_inference_steps": 3, "output_type": "latent"}

    def forward_loop(pipe):
        runs.append(pipe)
        with torch.inference_mode():
            pipe(prompt="a lighthouse in a storm", generator=torch.Generator().manual_seed(9), **call)

    recipe = RecipeConfig("ts", [W8A8TimestepConfig(calib_samples=SAMPLES, dynamic_steps=(1,))])
    with pytest.raises(RecipeError, match="loop ran 3 denoising steps but the recipe deploys at 4"):
        sdkiln.optimize("flux-tiny", recipe, forward_loop=forward_loop, eval_samples=0)
    recipe.deployment = Deployment(num_inference_steps=3)
    result = sdkiln.optimize("flux-tiny", recipe, forward_loop=forward_loop, eval_samples=0)
    step = result.manifest["recipe"]["steps"][0]["result"]
    assert runs[-1] is result.pipeline
    assert step["calibration"] == {"loop": "user", "steps": 3} and step["num_steps"] == 3
    assert set(e["num_steps"] for e in result.manifest["modules"].values()) == {3}
    assert result.manifest["call"]["defaults"]["num_inference_steps"] == 3
    assert result.files["calibration/config.json"] == {"w8a8_timestep": {"loop": "user", "steps": 3}}


def test_a_recipe_calibrated_at_other_steps_deploys_and_is_evaluated_at_those_steps(tmp_path):
    recipe = RecipeConfig(
        name="ts3",
        steps=[W8A8TimestepConfig(calib_samples=1, dynamic_steps=(1,))],
        deployment=Deployment(num_inference_steps=3),
    )
    result = sdkiln.optimize("flux-tiny", recipe, tmp_path / "p", eval_samples=1)
    assert result.manifest["call"]["defaults"]["num_inference_steps"] == 3
    assert result.quality["steps"] == 3
